//! Compute for the models bigmodel runs: a dense tensor on the CPU or a
//! CUDA GPU, and the operations a transformer is made of.
//!
//! This is the half of a framework that bigmodel's model crate needs and
//! that a framework embedding bigmodel already has: it knows nothing of
//! checkpoints, device maps or model families (that is `bm-models`), only
//! of bytes, dtypes, shapes and kernels.
//!
//! * [`Tensor`] is a dense F32/F16/BF16 tensor on one [`Backend`]: the CPU
//!   (host memory, which may borrow a memory-mapped checkpoint, own an
//!   aligned buffer, or share bytes another owner keeps alive), or a CUDA
//!   GPU (a `bm_device::DeviceBuffer`, with the `cuda` feature). Every op
//!   runs on the GPU of its first GPU operand and uploads host operands for
//!   it (an offloaded weight streamed to the execution device), through
//!   bm-device's compute: cuBLAS GEMMs and NVRTC kernels. Emulated GPUs do
//!   not compute: weights placed on them are used from host copies by the
//!   CPU kernels, which are also the reference the CUDA kernels are tested
//!   against.
//! * [`ops`] has what the model families need: matmul (`linear`, on the
//!   `gemm` crate's kernels with rayon threads over weight-row blocks, and
//!   `linear_t` for `Conv1D` weights stored `[in, out]`), embedding lookup,
//!   RMSNorm (Llama's and Gemma's `1 + w`), LayerNorm, rotary embedding
//!   (default, given or partial frequencies), attention with a causal or
//!   sliding-window mask, grouped-query heads, a score scale and
//!   soft-capping, and a KV cache that can forget what a window no longer
//!   sees; softmax, SiLU, GELU (exact and tanh), soft-capping, scale, add,
//!   mul and column splits; mixture-of-experts routing (softmax top-k)
//!   and the weighted sum of the experts' rows. Half-precision values are widened to f32,
//!   computed, and rounded once per op, as PyTorch's CPU kernels accumulate
//!   in f32. The few ops without a CUDA side yet (`linear_t`, tanh GELU,
//!   soft-capping, non-default rotary or scores) return
//!   [`Error::NotOnCuda`] for GPU operands.
//!
//! * [`quant`] holds bitsandbytes' quantized weights (NF4/FP4 4-bit,
//!   LLM.int8() 8-bit): formats, quantizing, transformers' checkpoint
//!   layout, and the dequantizing matmul `ops::linear_quantized` (and
//!   `ops::linear_quantized_on_gpu` for a weight held packed on a GPU).
//!
//! Why a crate of its own: the model families and the quantized kernels
//! grow independently, a framework that brings its own models can use the
//! ops alone, and a change to a model family does not rebuild the kernels.

mod cpu;
mod cuda;
mod error;
mod moe;
pub mod ops;
pub mod quant;
mod tensor;

pub use cpu::Isa;
pub use error::Error;
pub use tensor::{Backend, HostBytes, SharedDeviceBuffer, Tensor, is_compute_dtype};
