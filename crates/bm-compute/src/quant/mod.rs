//! Quantized weights with bitsandbytes' formats and semantics: what
//! Accelerate's `load_and_quantize_model` and transformers'
//! `BitsAndBytesConfig` produce, and what transformers saves for a
//! bitsandbytes model.
//!
//! * [`format`]: the 4-bit code tables (NF4, FP4), the 8-bit dynamic map of
//!   double quantization, the block sizes bitsandbytes accepts.
//! * [`QuantizedTensor`]: a linear weight's packed codes, absmax scales
//!   (plain or double-quantized) or LLM.int8()'s int8 rows and `SCB`, as
//!   plain byte buffers; read from and written to transformers' safetensors
//!   keys (`<w>`, `<w>.absmax`, `<w>.quant_map`, `<w>.nested_absmax`,
//!   `<w>.nested_quant_map`, `<w>.quant_state.bitsandbytes__nf4|fp4`; for
//!   8-bit `<w>` as I8, `<module>.SCB`, `<module>.weight_format`).
//! * [`quantize`]: dense to quantized, bit for bit as bitsandbytes on the CPU
//!   (the one deviation, the double-quantization offset's summation, is in
//!   docs/compat.md).
//! * [`linear_quantized`]: the matmul, dequantizing a few weight rows at a
//!   time into a per-thread buffer (threads, the `gemm` crate's SIMD); an
//!   input on a GPU runs it there with the weight uploaded packed.
//! * CUDA: [`QuantizedOnGpu`] is a weight's packed form in one device
//!   buffer (what a dispatcher holds on a GPU); [`linear_quantized_on_gpu`]
//!   reads it in place with bm-device's kernels (decode), or dequantizes it
//!   into a stream-ordered temporary for one cuBLAS GEMM (4-bit prefill).
//!   [`QuantizedTensor::dequantize_on`] dequantizes on a GPU, bit for bit
//!   the CPU's. [`quantize`] is CPU only
//!   ([`Error::NotOnCuda`](crate::Error::NotOnCuda) for a GPU operand).
//! * Planning and streaming: [`QuantizedTensor::to_packed`] /
//!   [`QuantizedTensor::from_packed`] give a weight as one byte buffer of
//!   [`QuantFormat::byte_len`] bytes, which a dispatcher holds, offloads and
//!   streams like any tensor; bm-plan sizes it by the same length
//!   (`bm_plan::quant`, checked equal in bm-models).

pub mod format;
mod gpu;
mod matmul;
mod quantize;
pub(crate) mod tensor;

pub use format::FourBitType;
pub use gpu::{QuantizedOnGpu, linear_quantized_on_gpu};
pub use matmul::linear_quantized;
pub use quantize::quantize;
pub use tensor::{Entry, PackedEntry, QuantFormat, QuantizedTensor};
