//! Model families written the way a framework embedding bigmodel would
//! write them, and the "open a folder and run it" API.
//!
//! A loader for models larger than any device is only real when a real
//! model runs through it, block by block, with each block's weights put in
//! place just before it runs and released after. The tensors and ops come
//! from `bm-compute` (re-exported here as [`Tensor`], [`Backend`] and
//! [`ops`]); this crate holds the models:
//!
//! * [`Decoder`] (every decoder family) and [`Encoder`] (BERT) hold only a
//!   config. Every block (`model.embed_tokens`, `model.layers.N`,
//!   `model.norm`, `lm_head`; `embeddings`, `encoder.layer.N`) is a method
//!   that takes its activations and a [`WeightSource`], fetches its tensors
//!   by transformers' names, and brackets the work with the source's
//!   `begin_block`/`end_block` hooks. That is the seam the dispatch layer
//!   uses to stream weights from GPU, CPU or disk.
//! * [`CausalLm`] (greedy generation from ids or text) and
//!   [`SentenceEmbedder`] (mean-pooled, L2-normalised embeddings) are the
//!   "open a folder and run it" API. Text goes through the `tokenizers`
//!   crate reading `tokenizer.json`.
//! * [`FolderWeights`] is the simplest source: a Hugging Face folder's
//!   safetensors (single or sharded) read through `bm_shard::Checkpoint`,
//!   zero-copy from the mmap when no cast is needed. Linear layers fetch
//!   their weights as [`LinearWeight`]s, which may be quantized with
//!   bitsandbytes' formats: read from a folder transformers saved from a
//!   bitsandbytes model, or quantized while loading
//!   ([`FolderWeights::open_quantized`] with [`QuantizeOptions`]).
//! * [`DispatchedWeights`] is the source over a dispatched `bigmodel`
//!   model: each block is one `enter`/`exit` of the model's hooks, so
//!   offloaded weights stream in (with prefetch) around every decoder
//!   layer. [`open_causal_lm`] and [`open_sentence_embedder`] open a
//!   folder under a device map, strategy, budgets and offload folder, as
//!   Accelerate's `load_checkpoint_and_dispatch` does.
//!
//! * [`T5`] is the encoder–decoder family (`T5ForConditionalGeneration`):
//!   blocks `encoder.block.N` and `decoder.block.N` (with the embeddings,
//!   final norms and `lm_head`) taking weights the same way; [`Seq2SeqLm`]
//!   and [`open_seq2seq_lm`] open a folder and generate from
//!   `decoder_start_token_id`, the prompt being the encoder's input.
//!
//! The decoder families (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma2`,
//! `phi3`, `gpt2`, and the mixtures of experts `mixtral`, `qwen2_moe`,
//! `qwen3_moe`, whose sparse MLPs fetch only the experts their router
//! picked) differ only in a [`DecoderConfig`]: `family.rs` turns
//! each family's config.json (read by the planner's reader,
//! `bigmodel::plan::config`, so both agree on every key) into what the
//! blocks compute, the way transformers does, and names its modules; one
//! set of blocks runs them all.
//!
//! Known limits: batch size 1 (embeddings run text by text, so no padding
//! is needed); rotary scaling other than Phi-3's LongRoPE is refused with
//! the key and value named. Sliding windows are applied in the attention
//! mask and the CPU KV cache of a sliding layer drops positions no later
//! query can see (GPU caches keep every position).

mod chat;
mod config;
mod decoder;
mod dispatched;
mod encoder;
mod error;
mod family;
mod generate;
mod generation_config;
mod moe;
mod packed;
mod quant_config;
mod quantized;
mod sampling;
mod seq2seq;
mod text;
mod weights;

pub use bm_compute::ops;
pub use bm_compute::{Backend, HostBytes, SharedDeviceBuffer, Tensor};

pub use chat::ChatTemplate;
pub use decoder::{CausalLm, Decoder, KvCache, Logits};
pub use dispatched::{
    Dispatched, DispatchedWeights, open_causal_lm, open_causal_lm_quantized,
    open_sentence_embedder, open_sentence_embedder_quantized, open_seq2seq_lm,
};
pub use encoder::{Encoder, EncoderConfig, SUPPORTED_ENCODERS, SentenceEmbedder};
pub use error::Error;
pub use family::{
    Activation, DecoderConfig, ExpertLayout, LongRope, Mlp, Moe, Norm, Positions, Projections,
    RopeConfig, SUPPORTED_DECODERS, SUPPORTED_GENERATORS,
};
pub use generate::{BatchSize, Batched, Conversation, GenerateOptions, Generation};
pub use generation_config::{DecoderStart, GenerationConfig};
pub use packed::{OwnedEntry, SaveQuantized, load_tree};
pub use quant_config::{BnbCheckpoint, QuantizeOptions};
pub use sampling::Sampling;
pub use seq2seq::{SUPPORTED_SEQ2SEQ, Seq2SeqCache, Seq2SeqLm, T5, T5Config, is_seq2seq};
pub use text::TextTokenizer;
pub use weights::{
    FolderWeights, LinearWeight, WeightLayout, WeightSource, family_kept_f32, folder_load_dtype,
};
