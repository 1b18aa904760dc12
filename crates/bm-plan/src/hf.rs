//! Module trees from Hugging Face `config.json` files, with transformers'
//! module names, class names, parameter shapes and registration order (as
//! of transformers 5.x): the Llama, Mistral, Qwen2, Qwen3, Gemma 2 and
//! Phi-3 causal LMs, GPT-2's `GPT2LMHeadModel`, BERT's `BertModel`, T5's
//! `T5ForConditionalGeneration` and the Mixtral, Qwen2-MoE and Qwen3-MoE
//! causal LMs.
//!
//! The mixture-of-experts layers follow the checkpoint layout, one module
//! per expert (`block_sparse_moe.experts.3.w1`, `mlp.experts.3.gate_proj`)
//! with the classes of transformers 4 that defined it: transformers 5
//! fuses each layer's experts into two 3-D parameters when it loads, and
//! writes them back out per expert when it saves. A tree in the
//! checkpoint's names is what loads from the checkpoint, and one module
//! per expert is what lets experts be placed on their own (`--experts-on`).
//! The layers are `_no_split_modules` either way, so Accelerate's maps,
//! which never go below a layer, are the same.

use bm_tensor::{DType, TensorMeta};

use crate::Error;
pub use crate::config::Family;
use crate::config::HfConfig;
use crate::ledger::{ModelShape, Workload};
use crate::tree::{ModuleId, ModuleTree, ModuleTreeBuilder};

/// A model described by a config.json.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// The family.
    pub family: Family,
    /// The module tree, parameters in the config's dtype.
    pub tree: ModuleTree,
    /// The family's `_no_split_modules`.
    pub no_split: Vec<String>,
    /// The repeated blocks that hold a KV cache (decoder layers; BERT's
    /// encoder layers; T5's decoder blocks), in order.
    pub layers: Vec<ModuleId>,
    /// KV-cache elements per token per layer (keys and values), for decoders.
    pub kv_elements_per_token: Option<u64>,
    /// The dtype the weights are stored in (`dtype`/`torch_dtype`, default F32).
    pub dtype: DType,
    /// The sizes behind the ledger's runtime items and the prediction.
    pub shape: ModelShape,
}

/// The ledger's runtime charges of a workload, per module, as
/// [`crate::PlanOptions`] takes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeCharges {
    /// KV cache per decoder layer (`PlanOptions::runtime_bytes`).
    pub kv: Vec<(ModuleId, u64)>,
    /// Activation peaks of the embedding and of every layer.
    pub activations: Vec<(ModuleId, u64)>,
    /// The logits buffer of the head.
    pub logits: Vec<(ModuleId, u64)>,
}

impl RuntimeCharges {
    /// Puts the charges into `options`.
    pub fn apply(self, options: &mut crate::PlanOptions) {
        options.runtime_bytes = self.kv;
        options.activation_peaks = self.activations;
        options.logits_bytes = self.logits;
    }
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

    /// The runtime charges of `workload` computed in `dtype`, with element
    /// sizes of a GPU (`on_gpu`) or of the CPU kernels (f32 activations and
    /// KV cache, see [`ModelShape::element_bytes`]).
    pub fn runtime_charges(
        &self,
        workload: &Workload,
        on_gpu: bool,
        dtype: DType,
    ) -> RuntimeCharges {
        let element = ModelShape::element_bytes(on_gpu, dtype);
        let kv = self.shape.kv_bytes_per_layer(workload, element);
        let peak = self.shape.activation_peak(workload, element);
        let module = |name: &str| match self.tree.find(name) {
            Some(crate::Node::Module(m)) => Some(m),
            _ => None,
        };
        let (embedding, head) = match self.family {
            Family::Bert => ("embeddings", None),
            Family::T5 => ("shared", Some("lm_head")),
            family => (DecoderNames::of(family).embed, Some("lm_head")),
        };
        let mut charges = RuntimeCharges::default();
        if kv > 0 {
            charges.kv = self.layers.iter().map(|m| (*m, kv)).collect();
        }
        if let Some(m) = module(embedding) {
            charges
                .activations
                .push((m, self.shape.embedding_peak(workload, element)));
        }
        charges
            .activations
            .extend(self.layers.iter().map(|m| (*m, peak)));
        if let Some(m) = head.and_then(module) {
            charges.logits.push((m, self.shape.logits_bytes(workload)));
        }
        charges
    }
}

/// transformers' module names of a decoder family: the blocks outside the
/// layers (full dotted names) and the norms inside a layer (names in the
/// layer). The planner builds its trees with them and bm-models finds a
/// family's weights by them: one table for both.
#[derive(Clone, Copy, Debug)]
pub struct DecoderNames {
    /// The token embedding block.
    pub embed: &'static str,
    /// The learned position embedding block, if any.
    pub positions: Option<&'static str>,
    /// The list of layers (`{layers}.{i}` are the blocks).
    pub layers: &'static str,
    /// The final norm block.
    pub final_norm: &'static str,
    /// Norm before attention.
    pub pre_attention: &'static str,
    /// Norm of the attention output, before the residual add.
    pub post_attention: Option<&'static str>,
    /// Norm before the MLP.
    pub pre_mlp: &'static str,
    /// Norm of the MLP output, before the residual add.
    pub post_mlp: Option<&'static str>,
}

impl DecoderNames {
    const LLAMA: DecoderNames = DecoderNames {
        embed: "model.embed_tokens",
        positions: None,
        layers: "model.layers",
        final_norm: "model.norm",
        pre_attention: "input_layernorm",
        post_attention: None,
        pre_mlp: "post_attention_layernorm",
        post_mlp: None,
    };

    /// The names of a decoder family (the Llama names for any family
    /// without its own).
    pub fn of(family: Family) -> DecoderNames {
        match family {
            Family::Gpt2 => DecoderNames {
                embed: "transformer.wte",
                positions: Some("transformer.wpe"),
                layers: "transformer.h",
                final_norm: "transformer.ln_f",
                pre_attention: "ln_1",
                post_attention: None,
                pre_mlp: "ln_2",
                post_mlp: None,
            },
            Family::Gemma2 => DecoderNames {
                post_attention: Some("post_attention_layernorm"),
                pre_mlp: "pre_feedforward_layernorm",
                post_mlp: Some("post_feedforward_layernorm"),
                ..DecoderNames::LLAMA
            },
            _ => DecoderNames::LLAMA,
        }
    }

    /// The norms of a layer in registration order.
    fn layer_norms(&self) -> impl Iterator<Item = &'static str> {
        [
            Some(self.pre_attention),
            self.post_attention,
            Some(self.pre_mlp),
            self.post_mlp,
        ]
        .into_iter()
        .flatten()
    }
}

/// transformers' module class of an activation.
fn activation_class(config: &HfConfig) -> Result<&'static str, Error> {
    let (name, key) = &config.activation;
    Ok(match name.as_str() {
        "silu" => "SiLUActivation",
        "swish" => "SiLU",
        "gelu" => "GELUActivation",
        "gelu_new" => "NewGELUActivation",
        "gelu_pytorch_tanh" => "GELUTanh",
        "gelu_fast" => "FastGELUActivation",
        "quick_gelu" => "QuickGELUActivation",
        "relu" => "ReLU",
        other => return Err(config.error(key, format!("unsupported activation {other:?}"))),
    })
}

/// The class the planner builds for a family (its `architectures` entry).
fn planned_class(family: Family) -> &'static str {
    match family {
        Family::Llama => "LlamaForCausalLM",
        Family::Mistral => "MistralForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        Family::Qwen3 => "Qwen3ForCausalLM",
        Family::Gemma2 => "Gemma2ForCausalLM",
        Family::Phi3 => "Phi3ForCausalLM",
        Family::Gpt2 => "GPT2LMHeadModel",
        Family::Bert => "BertModel",
        Family::Mixtral => "MixtralForCausalLM",
        Family::Qwen2Moe => "Qwen2MoeForCausalLM",
        Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        Family::T5 => "T5ForConditionalGeneration",
    }
}

/// Builds the model a config.json describes.
pub fn tree_from_config(config: &HfConfig) -> Result<HfModel, Error> {
    let dtype = config.dtype()?;
    let expected = planned_class(config.family);
    let archs = config.architectures()?;
    if !archs.is_empty() && !archs.contains(&expected) {
        return Err(config.error(
            "architectures",
            format!("{archs:?} are not supported; this family is planned as {expected}"),
        ));
    }
    match config.family {
        Family::Gpt2 => gpt2(config, dtype),
        Family::Bert => bert(config, dtype),
        Family::T5 => t5(config, dtype),
        family => decoder(config, family, dtype),
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

    /// A module by its full dotted name, under its parent built before.
    fn module_at(&mut self, path: &str, class: &str) -> Result<ModuleId, Error> {
        let (parent, local) = path.rsplit_once('.').unwrap_or(("", path));
        let parent = self
            .b
            .module_id(parent)
            .ok_or_else(|| Error::tree(path, "its parent module is not built yet"))?;
        self.module(parent, local, class)
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

    /// `gate_proj`, `up_proj`, `down_proj` and the activation of a gated MLP.
    fn gated_mlp(
        &mut self,
        mlp: ModuleId,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: &str,
    ) -> Result<(), Error> {
        self.linear(mlp, "gate_proj", hidden, inter, bias)?;
        self.linear(mlp, "up_proj", hidden, inter, bias)?;
        self.linear(mlp, "down_proj", inter, hidden, bias)?;
        self.module(mlp, "act_fn", act)?;
        Ok(())
    }

    /// A norm module with only a weight (RMSNorm, T5's LayerNorm).
    fn weight_norm(
        &mut self,
        parent: ModuleId,
        name: &str,
        class: &str,
        dim: usize,
    ) -> Result<ModuleId, Error> {
        let m = self.module(parent, name, class)?;
        self.param(m, "weight", &[dim])?;
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
fn decoder(cfg: &HfConfig, family: Family, dtype: DType) -> Result<HfModel, Error> {
    let prefix = match family {
        Family::Llama => "Llama",
        Family::Mistral => "Mistral",
        Family::Qwen2 => "Qwen2",
        Family::Qwen3 => "Qwen3",
        Family::Gemma2 => "Gemma2",
        Family::Mixtral => "Mixtral",
        Family::Qwen2Moe => "Qwen2Moe",
        Family::Qwen3Moe => "Qwen3Moe",
        _ => "Phi3",
    };
    let (vocab, hidden, inter) = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size);
    let (layers, heads, kv_heads, head_dim) =
        (cfg.num_layers, cfg.heads, cfg.kv_heads, cfg.head_dim);
    let (qkv_bias, o_bias, mlp_bias) = (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias);
    let gemma = family == Family::Gemma2;
    let tie = cfg.tie_word_embeddings;
    let act = activation_class(cfg)?;
    let rope_dim = cfg.rotary_dim.unwrap_or(head_dim);

    let mut b = B {
        b: ModuleTreeBuilder::new(format!("{prefix}ForCausalLM")),
        dtype,
    };
    let names = DecoderNames::of(family);
    let model = b.module(0, "model", &format!("{prefix}Model"))?;
    let embed = b.module_at(
        names.embed,
        if gemma {
            "Gemma2TextScaledWordEmbedding"
        } else {
            "Embedding"
        },
    )?;
    b.param(embed, "weight", &[vocab, hidden])?;
    if gemma {
        // A scalar created in the default dtype, which is the model's.
        b.b.add_buffer(embed, "embed_scale", TensorMeta::new(dtype, []), false)?;
    }
    let list = b.module_at(names.layers, "ModuleList")?;
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
        if matches!(family, Family::Qwen3 | Family::Qwen3Moe) {
            for norm in ["q_norm", "k_norm"] {
                let n = b.module(attn, norm, &norm_class)?;
                b.param(n, "weight", &[head_dim])?;
            }
        }
        if let Some(moe) = cfg.moe.as_ref().filter(|m| m.sparse_layers[i]) {
            sparse_moe(&mut b, layer, cfg, family, prefix, moe, act)?;
        } else if family == Family::Phi3 {
            let mlp = b.module(layer, "mlp", &format!("{prefix}MLP"))?;
            b.linear(mlp, "gate_up_proj", hidden, 2 * inter, false)?;
            b.linear(mlp, "down_proj", inter, hidden, false)?;
            b.module(mlp, "activation_fn", act)?;
        } else {
            let mlp = b.module(layer, "mlp", &format!("{prefix}MLP"))?;
            b.gated_mlp(mlp, hidden, inter, mlp_bias, act)?;
        }
        for norm in names.layer_norms() {
            b.weight_norm(layer, norm, &norm_class, hidden)?;
        }
        if family == Family::Phi3 {
            b.module(layer, "resid_attn_dropout", "Dropout")?;
            b.module(layer, "resid_mlp_dropout", "Dropout")?;
        }
    }
    let norm = b.module_at(names.final_norm, &norm_class)?;
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
        b.b.tie(&[
            "lm_head.weight".to_string(),
            format!("{}.weight", names.embed),
        ]);
    }
    Ok(HfModel {
        family,
        tree: b.b.finish()?,
        no_split: vec![format!("{prefix}DecoderLayer")],
        layers: layer_ids,
        kv_elements_per_token: Some(2 * (kv_heads * head_dim) as u64),
        dtype,
        shape: ModelShape::of(cfg),
    })
}

/// A sparse MoE block of layer `layer` in the checkpoint layout (see the
/// module docs): Mixtral's `block_sparse_moe` (router `gate`, experts with
/// `w1`, `w2`, `w3`), Qwen's `mlp` (router `gate`, experts with
/// `gate_proj`, `up_proj`, `down_proj`, and Qwen2-MoE's shared expert with
/// its one-output `shared_expert_gate`). [`crate::expert_lists`] finds the
/// experts lists by their name.
fn sparse_moe(
    b: &mut B,
    layer: ModuleId,
    cfg: &HfConfig,
    family: Family,
    prefix: &str,
    moe: &crate::config::MoeConfig,
    act: &str,
) -> Result<(), Error> {
    let hidden = cfg.hidden_size;
    let inter = moe.expert_intermediate_size;
    let mixtral = family == Family::Mixtral;
    let name = if mixtral { "block_sparse_moe" } else { "mlp" };
    let block = b.module(layer, name, &format!("{prefix}SparseMoeBlock"))?;
    b.linear(block, "gate", hidden, moe.experts, false)?;
    let list = b.module(block, "experts", "ModuleList")?;
    for e in 0..moe.experts {
        if mixtral {
            let expert = b.module(list, &e.to_string(), "MixtralBlockSparseTop2MLP")?;
            b.linear(expert, "w1", hidden, inter, false)?;
            b.linear(expert, "w2", inter, hidden, false)?;
            b.linear(expert, "w3", hidden, inter, false)?;
            b.module(expert, "act_fn", act)?;
        } else {
            let expert = b.module(list, &e.to_string(), &format!("{prefix}MLP"))?;
            b.gated_mlp(expert, hidden, inter, false, act)?;
        }
    }
    if let Some(shared) = moe.shared_expert_intermediate_size {
        let expert = b.module(block, "shared_expert", &format!("{prefix}MLP"))?;
        b.gated_mlp(expert, hidden, shared, false, act)?;
        b.linear(block, "shared_expert_gate", hidden, 1, false)?;
    }
    Ok(())
}

/// `T5ForConditionalGeneration`: the shared embedding, an encoder and a
/// decoder `T5Stack` (each block's first layer self-attention, the
/// decoder's second cross-attention, the last the feed-forward; block 0
/// holds the relative position bias), the head tied to `shared`.
fn t5(cfg: &HfConfig, dtype: DType) -> Result<HfModel, Error> {
    let s2s = cfg
        .seq2seq
        .as_ref()
        .ok_or_else(|| cfg.error("model_type", "not an encoder-decoder config"))?;
    let (vocab, d_model, d_ff) = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size);
    let inner = cfg.heads * cfg.head_dim;
    let act = activation_class(cfg)?;
    let mut b = B {
        b: ModuleTreeBuilder::new("T5ForConditionalGeneration"),
        dtype,
    };
    b.embedding(0, "shared", vocab, d_model)?;
    let mut decoder_blocks = Vec::with_capacity(s2s.decoder_layers);
    for (stack, layers) in [("encoder", cfg.num_layers), ("decoder", s2s.decoder_layers)] {
        let decoder = stack == "decoder";
        let st = b.module(0, stack, "T5Stack")?;
        b.embedding(st, "embed_tokens", vocab, d_model)?;
        let list = b.module(st, "block", "ModuleList")?;
        for i in 0..layers {
            let block = b.module(list, &i.to_string(), "T5Block")?;
            if decoder {
                decoder_blocks.push(block);
            }
            let sub = b.module(block, "layer", "ModuleList")?;
            let attention = |b: &mut B, index: &str, class: &str, name: &str, bias: bool| {
                let layer = b.module(sub, index, class)?;
                let attn = b.module(layer, name, "T5Attention")?;
                for proj in ["q", "k", "v"] {
                    b.linear(attn, proj, d_model, inner, false)?;
                }
                b.linear(attn, "o", inner, d_model, false)?;
                if bias {
                    b.embedding(
                        attn,
                        "relative_attention_bias",
                        s2s.relative_buckets,
                        cfg.heads,
                    )?;
                }
                b.weight_norm(layer, "layer_norm", "T5LayerNorm", d_model)?;
                b.module(layer, "dropout", "Dropout")
            };
            attention(&mut b, "0", "T5LayerSelfAttention", "SelfAttention", i == 0)?;
            if decoder {
                attention(
                    &mut b,
                    "1",
                    "T5LayerCrossAttention",
                    "EncDecAttention",
                    false,
                )?;
            }
            let ff = b.module(sub, if decoder { "2" } else { "1" }, "T5LayerFF")?;
            if s2s.gated {
                let dense = b.module(ff, "DenseReluDense", "T5DenseGatedActDense")?;
                b.linear(dense, "wi_0", d_model, d_ff, false)?;
                b.linear(dense, "wi_1", d_model, d_ff, false)?;
                b.linear(dense, "wo", d_ff, d_model, false)?;
                b.module(dense, "dropout", "Dropout")?;
                b.module(dense, "act", act)?;
            } else {
                let dense = b.module(ff, "DenseReluDense", "T5DenseActDense")?;
                b.linear(dense, "wi", d_model, d_ff, false)?;
                b.linear(dense, "wo", d_ff, d_model, false)?;
                b.module(dense, "dropout", "Dropout")?;
                b.module(dense, "act", act)?;
            }
            b.weight_norm(ff, "layer_norm", "T5LayerNorm", d_model)?;
            b.module(ff, "dropout", "Dropout")?;
        }
        b.weight_norm(st, "final_layer_norm", "T5LayerNorm", d_model)?;
        b.module(st, "dropout", "Dropout")?;
    }
    b.linear(0, "lm_head", d_model, vocab, false)?;
    let mut tied = vec![
        "decoder.embed_tokens.weight",
        "encoder.embed_tokens.weight",
        "shared.weight",
    ];
    if cfg.tie_word_embeddings {
        tied.push("lm_head.weight");
    }
    b.b.tie(&tied);
    Ok(HfModel {
        family: Family::T5,
        tree: b.b.finish()?,
        no_split: vec!["T5Block".into()],
        layers: decoder_blocks,
        kv_elements_per_token: Some(2 * inner as u64),
        dtype,
        shape: ModelShape::of(cfg),
    })
}

fn gpt2(cfg: &HfConfig, dtype: DType) -> Result<HfModel, Error> {
    let (vocab, embd, layers) = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers);
    let positions = cfg
        .max_positions
        .ok_or_else(|| cfg.error("n_positions", "missing"))?;
    let inner = cfg.intermediate_size;
    let act = activation_class(cfg)?;
    let tie = cfg.tie_word_embeddings;

    let mut b = B {
        b: ModuleTreeBuilder::new("GPT2LMHeadModel"),
        dtype,
    };
    let names = DecoderNames::of(Family::Gpt2);
    let transformer = b.module(0, "transformer", "GPT2Model")?;
    let wte = b.module_at(names.embed, "Embedding")?;
    b.param(wte, "weight", &[vocab, embd])?;
    if let Some(wpe) = names.positions {
        let wpe = b.module_at(wpe, "Embedding")?;
        b.param(wpe, "weight", &[positions, embd])?;
    }
    b.module(transformer, "drop", "Dropout")?;
    let h = b.module_at(names.layers, "ModuleList")?;
    let mut layer_ids = Vec::with_capacity(layers);
    for i in 0..layers {
        let block = b.module(h, &i.to_string(), "GPT2Block")?;
        layer_ids.push(block);
        b.layer_norm(block, names.pre_attention, embd)?;
        let attn = b.module(block, "attn", "GPT2Attention")?;
        b.conv1d(attn, "c_attn", embd, 3 * embd)?;
        b.conv1d(attn, "c_proj", embd, embd)?;
        b.module(attn, "attn_dropout", "Dropout")?;
        b.module(attn, "resid_dropout", "Dropout")?;
        b.layer_norm(block, names.pre_mlp, embd)?;
        let mlp = b.module(block, "mlp", "GPT2MLP")?;
        b.conv1d(mlp, "c_fc", embd, inner)?;
        b.conv1d(mlp, "c_proj", inner, embd)?;
        b.module(mlp, "act", act)?;
        b.module(mlp, "dropout", "Dropout")?;
    }
    let ln_f = b.module_at(names.final_norm, "LayerNorm")?;
    b.param(ln_f, "weight", &[embd])?;
    b.param(ln_f, "bias", &[embd])?;
    b.linear(0, "lm_head", embd, vocab, false)?;
    if tie {
        b.b.tie(&[
            "lm_head.weight".to_string(),
            format!("{}.weight", names.embed),
        ]);
    }
    Ok(HfModel {
        family: Family::Gpt2,
        tree: b.b.finish()?,
        no_split: vec!["GPT2Block".into()],
        layers: layer_ids,
        kv_elements_per_token: Some(2 * embd as u64),
        dtype,
        shape: ModelShape::of(cfg),
    })
}

fn bert(cfg: &HfConfig, dtype: DType) -> Result<HfModel, Error> {
    let (vocab, hidden, layers) = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers);
    let inter = cfg.intermediate_size;
    let positions = cfg
        .max_positions
        .ok_or_else(|| cfg.error("max_position_embeddings", "missing"))?;
    let types = cfg
        .type_vocab_size
        .ok_or_else(|| cfg.error("type_vocab_size", "missing"))?;
    let act = activation_class(cfg)?;

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
        shape: ModelShape::of(cfg),
    })
}
