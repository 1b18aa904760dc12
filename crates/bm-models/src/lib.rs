//! Model families written the way a framework embedding bigmodel would
//! write them, and the "open a folder and run it" API.
//!
//! A loader for models larger than any device is only real when a real
//! model runs through it, block by block, with each block's weights put in
//! place just before it runs and released after. The tensors and ops come
//! from `bm-compute` (re-exported here as [`Tensor`], [`Backend`] and
//! [`ops`]); this crate holds the models:
//!
//! * [`Decoder`] (Llama, Mistral, Qwen2) and [`Encoder`] (BERT) hold only a
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
//!   zero-copy from the mmap when no cast is needed.
//! * [`DispatchedWeights`] is the source over a dispatched `bigmodel`
//!   model: each block is one `enter`/`exit` of the model's hooks, so
//!   offloaded weights stream in (with prefetch) around every decoder
//!   layer. [`open_causal_lm`] and [`open_sentence_embedder`] open a
//!   folder under a device map, strategy, budgets and offload folder, as
//!   Accelerate's `load_checkpoint_and_dispatch` does.
//!
//! Known limits: batch size 1 (embeddings run text by text, so no padding
//! is needed); rotary scaling other than none is refused; Qwen2's
//! sliding-window layers are refused. Mistral's window is applied in the
//! attention mask (checked against transformers with a window shorter than
//! the prompt), but the KV cache keeps every position rather than a rolling
//! window, so memory grows with the sequence.

mod config;
mod decoder;
mod dispatched;
mod encoder;
mod error;
mod family;
mod text;
mod weights;

pub use bm_compute::ops;
pub use bm_compute::{Backend, HostBytes, SharedDeviceBuffer, Tensor};

pub use decoder::{CausalLm, Decoder, GenerateOptions, Generation, KvCache, Logits};
pub use dispatched::{Dispatched, DispatchedWeights, open_causal_lm, open_sentence_embedder};
pub use encoder::{Encoder, EncoderConfig, SUPPORTED_ENCODERS, SentenceEmbedder};
pub use error::Error;
pub use family::{
    Activation, DecoderArch, DecoderConfig, LongRope, Mlp, Norm, Positions, Projections,
    RopeConfig, SUPPORTED_DECODERS,
};
pub use text::TextTokenizer;
pub use weights::{FolderWeights, WeightSource};
