//! The error type of bm-compute: what an operation refused, and the
//! failures of the layers below it.

use std::fmt;

use bm_tensor::DType;

/// Everything that can go wrong in `bm-compute`.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An operation given tensors whose shapes do not fit together.
    BadOperands {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        message: String,
    },
    /// A dtype an operation cannot compute in (only F32, F16 and BF16 can).
    UnsupportedDType {
        /// What has the dtype (an op name or a tensor name).
        what: String,
        /// The dtype.
        dtype: DType,
    },
    /// An operation given nothing to work on (e.g. pooling an empty sequence).
    EmptyInput(&'static str),
    /// A token id not below the vocabulary size.
    TokenOutOfVocab {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// An operation whose CUDA side is not written yet, given a GPU operand.
    NotOnCuda {
        /// The operation (and the variant of it, when only some are missing).
        op: &'static str,
    },
    /// A quantization format, type or block size bigmodel does not
    /// implement (what, and what is supported).
    UnsupportedQuant(String),
    /// A quantized weight whose stored state is missing or inconsistent
    /// (a pre-quantized checkpoint's entries, or parts handed to
    /// `QuantizedTensor`).
    QuantState {
        /// The weight (`model.layers.0.mlp.up_proj.weight`).
        tensor: String,
        /// The part or quant-state field (`absmax`, `nested_offset`, `SCB`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A weight that cannot be quantized (non-finite values, a shape that
    /// is not a matrix).
    Quantize {
        /// The weight.
        tensor: String,
        /// Why.
        message: String,
    },
    /// An error from bm-tensor (casts, buffers, mmaps).
    Tensor(bm_tensor::Error),
    /// A device, its memory or its compute failed.
    Device(bm_device::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadOperands { op, message } => write!(f, "{op}: {message}"),
            Error::UnsupportedDType { what, dtype } => write!(
                f,
                "{what}: dtype {dtype} cannot be computed with (use F32, F16 or BF16)"
            ),
            Error::EmptyInput(what) => write!(f, "{what} is empty"),
            Error::TokenOutOfVocab { id, vocab_size } => write!(
                f,
                "token id {id} is out of the vocabulary (size {vocab_size})"
            ),
            Error::NotOnCuda { op } => write!(
                f,
                "{op} is not implemented on CUDA yet: place this block on the CPU (device map \"cpu\")"
            ),
            Error::UnsupportedQuant(what) => write!(f, "unsupported quantization: {what}"),
            Error::QuantState {
                tensor,
                field,
                message,
            } => write!(f, "quantized weight {tensor}: {field}: {message}"),
            Error::Quantize { tensor, message } => write!(f, "cannot quantize {tensor}: {message}"),
            Error::Tensor(e) => e.fmt(f),
            Error::Device(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Tensor(e) => Some(e),
            Error::Device(e) => Some(e),
            _ => None,
        }
    }
}

impl From<bm_tensor::Error> for Error {
    fn from(e: bm_tensor::Error) -> Self {
        Error::Tensor(e)
    }
}

impl From<bm_device::Error> for Error {
    fn from(e: bm_device::Error) -> Self {
        Error::Device(e)
    }
}
