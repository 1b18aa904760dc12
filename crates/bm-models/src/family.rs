//! The decoder families: what each architecture's `config.json` means and
//! how its modules are named (the blocks' and norms' names are bm-plan's
//! `DecoderNames`, the table the planner builds its trees with). Every
//! other difference between the families is decided here, once;
//! `decoder.rs` runs whatever a [`DecoderConfig`] describes.

use std::path::{Path, PathBuf};

use bigmodel::plan::config::{ConfigKeys, Family, Float, HfConfig, MAX_LAYERS, MAX_POSITIONS};
use bigmodel::plan::hf::DecoderNames;

use crate::config::{found, read_config, unsupported};
use crate::ops::{self, Heads, Scores};
use crate::{Error, Tensor};

/// The decoder families' `model_type`s, for the lists below.
macro_rules! decoder_types {
    () => {
        "llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2, mixtral, qwen2_moe, qwen3_moe"
    };
}

/// The decoder families' classes, for the lists below.
macro_rules! decoder_classes {
    () => {
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, \
         Gemma2ForCausalLM, Phi3ForCausalLM, GPT2LMHeadModel, MixtralForCausalLM, \
         Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"
    };
}

/// The decoder architectures this crate runs.
pub const SUPPORTED_DECODERS: &str = concat!(decoder_types!(), " (", decoder_classes!(), ")");

/// The architectures this crate generates text with: the decoders and T5.
pub const SUPPORTED_GENERATORS: &str = concat!(
    decoder_types!(),
    ", t5 (",
    decoder_classes!(),
    ", T5ForConditionalGeneration)"
);

/// The normalisation layers of a family.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Norm {
    /// Llama's RMSNorm, `w · round(x / rms(x))`.
    Rms {
        /// Epsilon.
        eps: f32,
    },
    /// Gemma's RMSNorm, `round(x / rms(x) · (1 + w))`.
    RmsPlusOne {
        /// Epsilon.
        eps: f32,
    },
    /// LayerNorm with weight and bias.
    Layer {
        /// Epsilon.
        eps: f32,
    },
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu` / `swish`.
    Silu,
    /// `gelu`: the exact erf form.
    Gelu,
    /// `gelu_new` / `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    /// `relu` (T5's feed-forward).
    Relu,
}

impl Activation {
    /// The activation applied elementwise to `t`.
    pub(crate) fn apply(self, t: &Tensor) -> Result<Tensor, Error> {
        Ok(ops::activate(t, self.op())?)
    }

    /// The compute op that applies it.
    pub(crate) fn op(self) -> ops::Activation {
        match self {
            Activation::Silu => ops::Activation::Silu,
            Activation::Gelu => ops::Activation::Gelu,
            Activation::GeluTanh => ops::Activation::GeluTanh,
            Activation::Relu => ops::Activation::Relu,
        }
    }

    /// The activation a config names (the key bm-plan read it from).
    pub(crate) fn of(c: &HfConfig) -> Result<Activation, Error> {
        let (name, key) = &c.activation;
        match name.as_str() {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu" => Ok(Activation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            "relu" => Ok(Activation::Relu),
            other => Err(c.error(
                key,
                format!(
                    "activation {other:?} is not supported (silu, swish, gelu, gelu_new, gelu_pytorch_tanh, relu)"
                ),
            )
            .into()),
        }
    }
}

/// How a layer projects queries, keys, values and the attention output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Projections {
    /// `self_attn.{q,k,v,o}_proj` linears.
    Separate {
        /// Biases on q/k/v.
        qkv_bias: bool,
        /// Bias on o.
        o_bias: bool,
    },
    /// One `self_attn.qkv_proj` linear (queries, keys, values in that
    /// order along its outputs) and `self_attn.o_proj`, without biases.
    FusedQkv,
    /// GPT-2's `attn.c_attn` and `attn.c_proj`: `Conv1D` (weights stored
    /// `[in, out]`) with biases.
    Conv1D,
}

/// How a layer's MLP is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// `down(act(gate(x)) · up(x))` with `mlp.{gate,up,down}_proj`.
    Gated {
        /// Biases on the three projections.
        bias: bool,
    },
    /// The same with gate and up fused in `mlp.gate_up_proj` (gate first).
    FusedGated,
    /// GPT-2's `c_proj(act(c_fc(x)))`, `Conv1D` with biases.
    Conv1D,
}

/// A mixture-of-experts MLP: a router (`gate`) sends each token to
/// `top_k` of `experts` small gated MLPs and sums their outputs, weighted.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Experts per sparse layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Width of one expert's MLP.
    pub expert_intermediate_size: usize,
    /// The top-k routing weights are divided by their sum.
    pub renormalize: bool,
    /// The routing weights are rounded to the compute dtype before they
    /// scale the experts' outputs (Qwen's routers return them in the
    /// model's dtype, Mixtral's in f32).
    pub round_weights: bool,
    /// Width of the shared expert that every token also goes through,
    /// scaled by `sigmoid(shared_expert_gate(x))` (Qwen2-MoE).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per layer: sparse (experts) or dense (the family's gated MLP).
    pub sparse_layers: Vec<bool>,
    /// Module names of the block.
    pub layout: ExpertLayout,
}

/// How a family names its experts (the checkpoint layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `block_sparse_moe.{gate, experts.N.{w1, w3, w2}}` (gate, up, down).
    Mixtral,
    /// `mlp.{gate, experts.N.{gate_proj, up_proj, down_proj}}`, and the
    /// shared expert `mlp.shared_expert` with `mlp.shared_expert_gate`.
    Qwen,
}

impl ExpertLayout {
    /// The sparse block's name inside a layer.
    pub fn block(self) -> &'static str {
        match self {
            ExpertLayout::Mixtral => "block_sparse_moe",
            ExpertLayout::Qwen => "mlp",
        }
    }

    /// An expert's gate, up and down projections.
    pub fn projections(self) -> [&'static str; 3] {
        match self {
            ExpertLayout::Mixtral => ["w1", "w3", "w2"],
            ExpertLayout::Qwen => ["gate_proj", "up_proj", "down_proj"],
        }
    }
}

/// Where positions enter the model.
#[derive(Clone, Debug, PartialEq)]
pub enum Positions {
    /// Rotary embedding of queries and keys.
    Rotary(RopeConfig),
    /// A learned table added to the token embedding (GPT-2's `wpe`).
    Learned {
        /// Rows of the table: the longest sequence.
        max_positions: usize,
    },
}

/// Rotary embedding settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base of the frequencies.
    pub theta: f32,
    /// Dimensions of each head that rotate (the head size unless
    /// `partial_rotary_factor` says less).
    pub rotary_dim: usize,
    /// Phi-3's LongRoPE scaling, if configured.
    pub long_rope: Option<LongRope>,
}

/// LongRoPE (Phi-3): frequencies divided by per-dimension factors, the
/// short ones while a forward pass ends within the original context, the
/// long ones beyond it; cos and sin multiplied by an attention factor.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    /// Factors up to `original_max_positions` (`rotary_dim / 2` of them).
    pub short_factor: Vec<f32>,
    /// Factors beyond it.
    pub long_factor: Vec<f32>,
    /// The pre-training context (`original_max_position_embeddings`).
    pub original_max_positions: usize,
    /// Multiplier of cos and sin.
    pub attention_factor: f32,
}

/// What a decoder's `config.json` says, in the terms the blocks use.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// The family: a causal LM's ([`Family::is_causal_lm`]).
    pub arch: Family,
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
    /// The norms (every norm of the model is of this kind).
    pub norm: Norm,
    /// Positions.
    pub positions: Positions,
    /// The attention projections.
    pub projections: Projections,
    /// RMS norms of each query and key head before rotary (Qwen3).
    pub qk_norm: bool,
    /// How attention scores are scaled and capped.
    pub scores: Scores,
    /// The attention window of each layer (`None`: full causal attention).
    pub windows: Vec<Option<usize>>,
    /// The MLP (of the dense layers, when some layers are sparse).
    pub mlp: Mlp,
    /// The experts of the sparse layers (MoE families).
    pub moe: Option<Moe>,
    /// The MLP's activation.
    pub activation: Activation,
    /// Factor on the token embedding (Gemma's `√hidden_size`), rounded to
    /// the compute dtype before use.
    pub embed_scale: Option<f32>,
    /// Soft-capping of the final logits.
    pub final_softcap: Option<f32>,
    /// `lm_head` shares the token embedding's weight.
    pub tie_word_embeddings: bool,
    /// Tokens that end generation (`eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    /// The longest sequence (`max_position_embeddings`, GPT-2's
    /// `n_positions`): generation stops there. `None` when the config
    /// does not say.
    pub max_positions: Option<usize>,
}

impl DecoderConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<DecoderConfig, Error> {
        DecoderConfig::from_config(&read_config(dir.as_ref(), SUPPORTED_DECODERS)?)
    }

    /// Parses config JSON already in memory; `path` names it in errors.
    pub fn from_json(
        path: impl Into<PathBuf>,
        json: serde_json::Value,
    ) -> Result<DecoderConfig, Error> {
        let config =
            HfConfig::from_value(json, path).map_err(|e| unsupported(e, SUPPORTED_DECODERS))?;
        DecoderConfig::from_config(&config)
    }

    /// The decoder a config (read by bm-plan's config reader) describes.
    pub fn from_config(c: &HfConfig) -> Result<DecoderConfig, Error> {
        if !c.family.is_causal_lm() {
            return Err(Error::UnsupportedArchitecture {
                found: found(c.family.model_type(), &c.architectures()?),
                supported: SUPPORTED_DECODERS,
            });
        }
        let config = match c.family {
            Family::Gpt2 => gpt2(c)?,
            arch => rotary_decoder(c, arch)?,
        };
        if config.windows.len() != config.num_layers {
            return Err(c
                .error(
                    "layer_types",
                    format!(
                        "{} entries for {} layers",
                        config.windows.len(),
                        config.num_layers
                    ),
                )
                .into());
        }
        Ok(config)
    }

    /// The module names of this config's family (bm-plan's table, which
    /// the planner builds its trees with).
    pub(crate) fn names(&self) -> DecoderNames {
        DecoderNames::of(self.arch)
    }

    /// The token embedding's weight (`model.embed_tokens.weight`,
    /// `transformer.wte.weight`): its stored dtype is the model's.
    pub fn embedding_weight(&self) -> String {
        format!("{}.weight", self.names().embed)
    }
}

/// The rotary families (Llama and its descendants).
fn rotary_decoder(c: &HfConfig, arch: Family) -> Result<DecoderConfig, Error> {
    use Family::*;
    let k = &c.keys;
    let heads = heads(c);
    let eps = k.opt_f64("rms_norm_eps", Float::Epsilon)?.unwrap_or(1e-6) as f32;
    let gemma = arch == Gemma2;
    if gemma && k.bool_or("use_bidirectional_attention", false)? {
        return Err(k
            .error(
                "use_bidirectional_attention",
                "bidirectional Gemma 2 (an encoder) is not supported",
            )
            .into());
    }
    let scores = match arch {
        Gemma2 => Scores {
            softcap: k
                .nullable_f64("attn_logit_softcapping", Some(50.0), Float::Scale)?
                .map(|v| v as f32),
            ..Scores::scaled_by(
                k.opt_f64("query_pre_attn_scalar", Float::Scale)?
                    .unwrap_or(256.0) as f32,
            )
        },
        _ => Scores::standard(heads.head_dim),
    };
    Ok(DecoderConfig {
        arch,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_layers: c.num_layers,
        heads,
        norm: if gemma {
            Norm::RmsPlusOne { eps }
        } else {
            Norm::Rms { eps }
        },
        positions: Positions::Rotary(rope(c, arch)?),
        projections: match arch {
            Phi3 => Projections::FusedQkv,
            _ => Projections::Separate {
                qkv_bias: c.qkv_bias,
                o_bias: c.o_bias,
            },
        },
        qk_norm: matches!(arch, Qwen3 | Qwen3Moe),
        scores,
        windows: windows(k, arch, c.num_layers)?,
        mlp: match arch {
            Phi3 => Mlp::FusedGated,
            _ => Mlp::Gated { bias: c.mlp_bias },
        },
        moe: c.moe.as_ref().map(|m| Moe {
            experts: m.experts,
            top_k: m.top_k,
            expert_intermediate_size: m.expert_intermediate_size,
            renormalize: m.norm_topk_prob,
            round_weights: arch != Mixtral,
            shared_expert_intermediate_size: m.shared_expert_intermediate_size,
            sparse_layers: m.sparse_layers.clone(),
            layout: match arch {
                Mixtral => ExpertLayout::Mixtral,
                _ => ExpertLayout::Qwen,
            },
        }),
        activation: Activation::of(c)?,
        embed_scale: gemma.then(|| (c.hidden_size as f64).sqrt() as f32),
        final_softcap: if gemma {
            k.nullable_f64("final_logit_softcapping", Some(30.0), Float::Scale)?
                .map(|v| v as f32)
        } else {
            None
        },
        tie_word_embeddings: c.tie_word_embeddings,
        eos_token_ids: k.token_ids("eos_token_id")?,
        max_positions: k.opt_count("max_position_embeddings", MAX_POSITIONS)?,
    })
}

/// `GPT2LMHeadModel`.
fn gpt2(c: &HfConfig) -> Result<DecoderConfig, Error> {
    let k = &c.keys;
    // Variants of the attention this crate does not run.
    for (key, supported) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
        ("add_cross_attention", false),
    ] {
        if k.bool_or(key, supported)? != supported {
            return Err(k
                .error(
                    key,
                    format!("{} is not supported (only {supported})", !supported),
                )
                .into());
        }
    }
    let max_positions = c
        .max_positions
        .ok_or_else(|| c.error("n_positions", "missing"))?;
    Ok(DecoderConfig {
        arch: Family::Gpt2,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_layers: c.num_layers,
        heads: heads(c),
        norm: Norm::Layer {
            eps: k
                .opt_f64("layer_norm_epsilon", Float::Epsilon)?
                .unwrap_or(1e-5) as f32,
        },
        positions: Positions::Learned { max_positions },
        projections: Projections::Conv1D,
        qk_norm: false,
        scores: Scores::standard(c.head_dim),
        windows: vec![None; c.num_layers],
        mlp: Mlp::Conv1D,
        moe: None,
        activation: Activation::of(c)?,
        embed_scale: None,
        final_softcap: None,
        tie_word_embeddings: c.tie_word_embeddings,
        eos_token_ids: k.token_ids("eos_token_id")?,
        max_positions: Some(max_positions),
    })
}

/// The attention geometry the config reader checked.
fn heads(c: &HfConfig) -> Heads {
    Heads {
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
    }
}

/// Rotary settings: transformers 5 keeps them in `rope_parameters`, older
/// configs in `rope_theta` / `rope_scaling`. Unscaled rope for every
/// family; Phi-3 also runs LongRoPE (`longrope`, and the legacy `su` and
/// `yarn` names transformers maps to it) and partial rotary (the rotated
/// dimensions are the config reader's `rotary_dim`).
fn rope(c: &HfConfig, arch: Family) -> Result<RopeConfig, Error> {
    let k = &c.keys;
    let (field, params) = match k.nested("rope_parameters")? {
        Some(p) => ("rope_parameters", Some(p)),
        None => ("rope_scaling", k.nested("rope_scaling")?),
    };
    let rope_type = match &params {
        Some(p) => match p.opt_str("rope_type")? {
            Some(t) => Some(t),
            None => p.opt_str("type")?,
        },
        None => None,
    }
    .unwrap_or("default");
    let theta = match &params {
        Some(p) => p.opt_f64("rope_theta", Float::Base)?,
        None => None,
    };
    let theta = theta
        .or(k.opt_f64("rope_theta", Float::Base)?)
        .unwrap_or(10000.0) as f32;
    let phi3 = arch == Family::Phi3;
    let rotary_dim = c.rotary_dim.unwrap_or(c.head_dim);
    let long_rope = match (rope_type, &params) {
        ("default", _) => None,
        ("longrope" | "su" | "yarn", Some(params)) if phi3 => {
            Some(long_rope(k, params, rotary_dim)?)
        }
        (other, _) => {
            let supported = if phi3 {
                "default, longrope (su, yarn)"
            } else {
                "default"
            };
            return Err(k
                .error(
                    &format!("{field}.rope_type"),
                    format!(
                        "rope type {other:?} is not supported for {arch:?} (supported: {supported})"
                    ),
                )
                .into());
        }
    };
    // Scaling factors are checked even where the rope type leaves them
    // unused.
    if let Some(p) = &params {
        p.opt_f64("factor", Float::Scale)?;
        p.opt_f64("attention_factor", Float::Scale)?;
    }
    Ok(RopeConfig {
        theta,
        rotary_dim,
        long_rope,
    })
}

/// Phi-3's LongRoPE parameters, with transformers' defaults: the original
/// context from the config's top level first, the factor from the context
/// ratio, the attention factor `√(1 + ln factor / ln original)`.
fn long_rope(k: &ConfigKeys, params: &ConfigKeys, rotary_dim: usize) -> Result<LongRope, Error> {
    let factors = |key: &str| -> Result<Vec<f32>, Error> {
        let values = params
            .opt_f64s(key, Float::Scale)?
            .ok_or_else(|| params.error(key, "missing (LongRoPE needs it)"))?;
        if values.len() != rotary_dim / 2 {
            return Err(params
                .error(
                    key,
                    format!(
                        "{} factors for {} rotary frequencies",
                        values.len(),
                        rotary_dim / 2
                    ),
                )
                .into());
        }
        Ok(values.into_iter().map(|v| v as f32).collect())
    };
    let original_key = "original_max_position_embeddings";
    // Both places are checked, though the top level's wins.
    let nested = params.opt_count(original_key, MAX_POSITIONS)?;
    let original = match k.opt_count(original_key, MAX_POSITIONS)?.or(nested) {
        Some(n) => n,
        None => k.count("max_position_embeddings", MAX_POSITIONS)?,
    };
    let factor = match params.opt_f64("factor", Float::Scale)? {
        Some(f) => f,
        None => k.count("max_position_embeddings", MAX_POSITIONS)? as f64 / original as f64,
    };
    let attention_factor = match params.opt_f64("attention_factor", Float::Scale)? {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_positions: original,
        attention_factor: attention_factor as f32,
    })
}

/// Each layer's attention window, as transformers decides it:
/// * Mistral and Phi-3: `sliding_window` for every layer when set;
/// * Qwen2 and Qwen3: `sliding_window` only with `use_sliding_window`, on
///   the layers `layer_types` marks `sliding_attention` (by default those
///   from `max_window_layers` on);
/// * Gemma 2: `sliding_window` on the `sliding_attention` layers (by
///   default every other one, starting with the first);
/// * Mixtral: `sliding_window` for every layer when set (no default);
/// * Qwen2-MoE: as Qwen2, but by default the even layers below
///   `max_window_layers` slide;
/// * Qwen3-MoE: `sliding_window` for every layer with `use_sliding_window`;
/// * Llama: none.
fn windows(k: &ConfigKeys, arch: Family, layers: usize) -> Result<Vec<Option<usize>>, Error> {
    use Family::*;
    // transformers' defaults when the key is absent (null means no window).
    let window = |default| k.nullable_count("sliding_window", default, MAX_POSITIONS);
    match arch {
        Mistral => Ok(vec![window(Some(4096))?; layers]),
        Phi3 => Ok(vec![window(None)?; layers]),
        Qwen2 | Qwen3 => {
            let window = if k.bool_or("use_sliding_window", false)? {
                window(Some(4096))?
            } else {
                None
            };
            let first_sliding = k.opt_count("max_window_layers", MAX_LAYERS)?.unwrap_or(28);
            layer_windows(k, window, layers, |i| {
                window.is_some() && i >= first_sliding
            })
        }
        Gemma2 => layer_windows(k, window(Some(4096))?, layers, |i| i % 2 == 0),
        Mixtral => Ok(vec![window(None)?; layers]),
        Qwen2Moe => {
            let window = if k.bool_or("use_sliding_window", false)? {
                window(Some(4096))?
            } else {
                None
            };
            let below = k.opt_count("max_window_layers", MAX_LAYERS)?.unwrap_or(28);
            layer_windows(k, window, layers, |i| {
                window.is_some() && i % 2 == 0 && i < below
            })
        }
        Qwen3Moe => match k.bool_or("use_sliding_window", false)? {
            true => Ok(vec![window(Some(4096))?; layers]),
            false => Ok(vec![None; layers]),
        },
        // Bert and T5 are not decoders: no config of theirs gets here.
        Llama | Gpt2 | Bert | T5 => Ok(vec![None; layers]),
    }
}

/// Windows from `layer_types`, or from `default_sliding(layer)` when the
/// config has none.
fn layer_windows(
    k: &ConfigKeys,
    window: Option<usize>,
    layers: usize,
    default_sliding: impl Fn(usize) -> bool,
) -> Result<Vec<Option<usize>>, Error> {
    let Some(types) = k.opt_strings("layer_types")? else {
        return Ok((0..layers)
            .map(|i| window.filter(|_| default_sliding(i)))
            .collect());
    };
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match *t {
            "full_attention" => Ok(None),
            "sliding_attention" => window.map(Some).ok_or_else(|| {
                k.error(
                    "layer_types",
                    format!(
                        "layer {i} is sliding_attention but no sliding_window is in effect \
                         (sliding_window null, or use_sliding_window false)"
                    ),
                )
                .into()
            }),
            other => Err(k
                .error(
                    "layer_types",
                    format!(
                        "layer {i} has attention type {other:?} (supported: full_attention, sliding_attention)"
                    ),
                )
                .into()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(config: serde_json::Value) -> Result<DecoderConfig, Error> {
        DecoderConfig::from_json("config.json", config)
    }

    fn qwen(extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({
            "model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    #[test]
    fn qwen_windows_follow_use_sliding_window_and_max_window_layers() {
        let off = parse(qwen(json!({"sliding_window": 4, "max_window_layers": 1}))).unwrap();
        assert_eq!(off.windows, [None; 4]);
        // Without layer_types (configs older than transformers 5).
        let on = json!({"use_sliding_window": true, "sliding_window": 4, "max_window_layers": 2});
        let derived = parse(qwen(on.clone())).unwrap();
        assert_eq!(derived.windows, [None, None, Some(4), Some(4)]);
        // layer_types, when present, decides.
        let mut typed = on;
        typed["layer_types"] = json!([
            "sliding_attention",
            "full_attention",
            "full_attention",
            "full_attention"
        ]);
        assert_eq!(
            parse(qwen(typed)).unwrap().windows,
            [Some(4), None, None, None]
        );
        let err = parse(qwen(json!({"layer_types": vec!["sliding_attention"; 4]}))).unwrap_err();
        assert!(
            err.to_string().contains("no sliding_window is in effect"),
            "{err}"
        );
        let err = parse(qwen(json!({
            "use_sliding_window": true, "sliding_window": 4,
            "layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]
        })))
        .unwrap_err();
        assert!(err.to_string().contains("\"chunked_attention\""), "{err}");
        let err = parse(qwen(json!({"layer_types": ["full_attention"]}))).unwrap_err();
        assert!(err.to_string().contains("1 entries for 4 layers"), "{err}");
    }

    #[test]
    fn gemma2_defaults_alternate_windows_and_cap_both_logits() {
        let g = parse(json!({
            "model_type": "gemma2", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 8,
            "final_logit_softcapping": null,
        }))
        .unwrap();
        assert_eq!(g.windows, [Some(4096), None, Some(4096)]);
        assert_eq!(g.scores.softcap, Some(50.0));
        assert_eq!(g.scores.scale, 1.0 / 16.0);
        assert_eq!(g.final_softcap, None);
        assert_eq!(g.embed_scale, Some(4.0));
        assert!(g.tie_word_embeddings);
        assert_eq!(g.activation, Activation::GeluTanh);
    }

    #[test]
    fn every_float_key_is_range_checked_and_named() {
        let gemma2 = |extra: serde_json::Value| {
            let mut c = json!({
                "model_type": "gemma2", "vocab_size": 8, "hidden_size": 16,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "head_dim": 8,
            });
            for (k, v) in extra.as_object().unwrap() {
                c[k] = v.clone();
            }
            parse(c)
        };
        let phi3 = |rope: serde_json::Value| {
            parse(json!({
                "model_type": "phi3", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
                "rope_scaling": rope,
            }))
        };
        let longrope = |extra: serde_json::Value| {
            let mut rope = json!({"type": "longrope", "short_factor": vec![1.0; 4],
                                  "long_factor": vec![2.0; 4]});
            for (k, v) in extra.as_object().unwrap() {
                rope[k] = v.clone();
            }
            phi3(rope)
        };
        let gpt2 = |eps: serde_json::Value| {
            parse(json!({
                "model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
                "n_positions": 8, "layer_norm_epsilon": eps,
            }))
        };
        for (config, key) in [
            (parse(qwen(json!({"rms_norm_eps": -1e-6}))), "rms_norm_eps"),
            (parse(qwen(json!({"rms_norm_eps": 1e30}))), "rms_norm_eps"),
            (parse(qwen(json!({"rope_theta": 0}))), "rope_theta"),
            (parse(qwen(json!({"rope_theta": 1e39}))), "rope_theta"),
            (
                parse(qwen(json!({"rope_parameters": {"rope_theta": -5.0}}))),
                "rope_parameters.rope_theta",
            ),
            (
                parse(qwen(
                    json!({"rope_parameters": {"rope_type": "default", "factor": 1e30}}),
                )),
                "rope_parameters.factor",
            ),
            (
                gemma2(json!({"attn_logit_softcapping": 0.0})),
                "attn_logit_softcapping",
            ),
            (
                gemma2(json!({"final_logit_softcapping": 1e30})),
                "final_logit_softcapping",
            ),
            (
                gemma2(json!({"query_pre_attn_scalar": 0})),
                "query_pre_attn_scalar",
            ),
            (gpt2(json!(-0.5)), "layer_norm_epsilon"),
            (
                longrope(json!({"short_factor": [1.0, 0.0, 1.0, 1.0]})),
                "rope_scaling.short_factor",
            ),
            (
                longrope(json!({"long_factor": [1.0, 1e30, 1.0, 1.0]})),
                "rope_scaling.long_factor",
            ),
            (longrope(json!({"factor": -2.0})), "rope_scaling.factor"),
            (
                longrope(json!({"attention_factor": 1e30})),
                "rope_scaling.attention_factor",
            ),
        ] {
            let err = config.unwrap_err().to_string();
            assert!(
                err.contains(&format!("config.json: key \"{key}\": "))
                    && err.contains("out of range"),
                "{key}: {err}"
            );
        }
        // Shadowed by the top level's, still checked.
        let mut shadowed = json!({
            "model_type": "phi3", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
            "original_max_position_embeddings": 8,
            "rope_scaling": {"type": "longrope", "short_factor": vec![1.0; 4],
                             "long_factor": vec![2.0; 4], "original_max_position_embeddings": -1},
        });
        let err = parse(shadowed.clone()).unwrap_err().to_string();
        assert!(
            err.contains("key \"rope_scaling.original_max_position_embeddings\": expected a positive integer, found -1"),
            "{err}"
        );
        shadowed["rope_scaling"]["original_max_position_embeddings"] = json!(4);
        let Positions::Rotary(rope) = parse(shadowed).unwrap().positions else {
            panic!("phi3 is rotary")
        };
        assert_eq!(rope.long_rope.unwrap().original_max_positions, 8);
        // In range: accepted as before.
        assert!(
            gemma2(json!({"query_pre_attn_scalar": 144, "attn_logit_softcapping": null})).is_ok()
        );
        assert!(longrope(json!({"factor": 16.0, "attention_factor": 1.2})).is_ok());
    }

    #[test]
    fn unsupported_variants_name_the_field_and_value() {
        let phi3 = |rope: serde_json::Value| {
            parse(json!({
                "model_type": "phi3", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
                "rope_scaling": rope,
            }))
        };
        let err = phi3(json!({"type": "dynamic", "factor": 2.0})).unwrap_err();
        assert!(
            err.to_string().contains("\"rope_scaling.rope_type\"")
                && err.to_string().contains("\"dynamic\""),
            "{err}"
        );
        // The legacy name `su` is LongRoPE; its factors must fit the head.
        let err = phi3(json!({"type": "su", "short_factor": [1.0], "long_factor": vec![1.0; 4]}))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("\"rope_scaling.short_factor\": 1 factors for 4 rotary frequencies"),
            "{err}"
        );
        let su =
            phi3(json!({"type": "su", "short_factor": vec![1.0; 4], "long_factor": vec![2.0; 4]}))
                .unwrap();
        let Positions::Rotary(rope) = su.positions else {
            panic!("phi3 is rotary")
        };
        let long = rope.long_rope.unwrap();
        // No original context given: max_position_embeddings, factor 1.
        assert_eq!(
            (long.original_max_positions, long.attention_factor),
            (64, 1.0)
        );
        let err = parse(json!({
            "model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
            "n_positions": 8, "scale_attn_by_inverse_layer_idx": true,
        }))
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("\"scale_attn_by_inverse_layer_idx\": true is not supported"),
            "{err}"
        );
        let err = parse(qwen(
            json!({"model_type": "qwen3", "hidden_act": "quick_gelu"}),
        ))
        .unwrap_err();
        assert!(
            err.to_string().contains("activation \"quick_gelu\""),
            "{err}"
        );
    }
}
