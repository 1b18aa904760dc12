//! The one error type of `bm-models`.

use std::fmt;
use std::path::PathBuf;

use bm_tensor::DType;

/// Everything that can go wrong in `bm-models`.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// Reading a file failed.
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A config file that does not parse, or a key of it that is missing
    /// or has a value this crate cannot use.
    Config {
        /// The config file.
        path: PathBuf,
        /// The key (dotted for a nested object); empty for the whole file.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A model type this crate does not implement.
    UnsupportedArchitecture {
        /// The `model_type` / `architectures` found.
        found: String,
        /// The ones that are supported.
        supported: &'static str,
    },
    /// A model folder without weights.
    MissingWeights {
        /// The folder.
        dir: PathBuf,
        /// The folder may not be listed (permission denied): only
        /// transformers' file names were looked up.
        unlisted: bool,
    },
    /// A tensor a block needs that the weight source does not have.
    MissingTensor {
        /// Its full name (`model.layers.3.self_attn.q_proj.weight`).
        name: String,
    },
    /// A tensor stored quantized (bitsandbytes) asked for as a dense
    /// tensor: only linear layers take quantized weights.
    QuantizedNotLinear {
        /// The tensor's full name.
        name: String,
    },
    /// A weight whose shape disagrees with the config.
    ShapeMismatch {
        /// The tensor's full name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape found.
        found: Vec<usize>,
    },
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
    /// A prompt or a text list with nothing in it.
    EmptyInput(&'static str),
    /// A sequence longer than the model's position table.
    SequenceTooLong {
        /// Tokens asked for.
        len: usize,
        /// `max_position_embeddings`.
        max: usize,
    },
    /// The tokenizer failed to load or to encode/decode.
    Tokenizer {
        /// The tokenizer.json file.
        path: PathBuf,
        /// What the tokenizers crate said.
        message: String,
    },
    /// A generation setting out of its range (a temperature of zero, a
    /// top-p above one).
    BadGenerateOption {
        /// The setting, as transformers' `GenerationConfig` names it.
        option: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A chat template is missing, does not parse, or failed to render
    /// (its own `raise_exception` included).
    ChatTemplate {
        /// The file the template comes from (tokenizer_config.json or
        /// chat_template.jinja).
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Text was given but the model folder has no tokenizer.json.
    NoTokenizer {
        /// The model folder.
        dir: PathBuf,
    },
    /// An operation failed (bm-compute: operands, dtypes, kernels).
    Compute(bm_compute::Error),
    /// An error from bm-tensor (casts, buffers, mmaps).
    Tensor(bm_tensor::Error),
    /// An error reading the checkpoint (bm-shard: headers, indexes, shards).
    Shard(bm_shard::Error),
    /// An error planning a device map (bm-plan), e.g. an unusable config.
    Plan(bigmodel::plan::Error),
    /// An error loading or running a dispatched model (bm-dispatch).
    Dispatch(bigmodel::dispatch::Error),
    /// A device, its memory or its compute failed.
    Device(bigmodel::device::Error),
    /// The facade failed otherwise (its errors of the layers above are
    /// unwrapped into `Shard`, `Plan`, `Dispatch` and `Device`).
    Facade(bigmodel::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Config { path, key, message } if key.is_empty() => {
                write!(f, "{}: {message}", path.display())
            }
            Error::Config { path, key, message } => {
                write!(f, "{}: key {key:?}: {message}", path.display())
            }
            Error::UnsupportedArchitecture { found, supported } => {
                write!(
                    f,
                    "unsupported architecture {found:?}: supported are {supported}"
                )
            }
            Error::MissingWeights { dir, unlisted } => {
                write!(
                    f,
                    "{}: no weights (expected model.safetensors, a *.index.json or pytorch_model.bin)",
                    dir.display()
                )?;
                if *unlisted {
                    f.write_str(
                        "; permission denied listing the folder, so only model.safetensors, \
                         model.safetensors.index.json, pytorch_model.bin and \
                         pytorch_model.bin.index.json were looked up by name",
                    )?;
                }
                Ok(())
            }
            Error::MissingTensor { name } => write!(f, "tensor {name} not found in the weights"),
            Error::QuantizedNotLinear { name } => write!(
                f,
                "tensor {name} is stored quantized (bitsandbytes); only linear layers can use it"
            ),
            Error::ShapeMismatch {
                name,
                expected,
                found,
            } => write!(
                f,
                "tensor {name} has shape {found:?} but the config implies {expected:?}"
            ),
            Error::BadOperands { op, message } => write!(f, "{op}: {message}"),
            Error::UnsupportedDType { what, dtype } => write!(
                f,
                "{what}: dtype {dtype} cannot be computed with (use F32, F16 or BF16)"
            ),
            Error::EmptyInput(what) => write!(f, "{what} is empty"),
            Error::SequenceTooLong { len, max } => write!(
                f,
                "sequence of {len} tokens is longer than the model's {max} positions"
            ),
            Error::Tokenizer { path, message } => {
                write!(f, "{}: tokenizer: {message}", path.display())
            }
            Error::BadGenerateOption { option, message } => write!(f, "{option}: {message}"),
            Error::ChatTemplate { path, message } => {
                write!(f, "{}: chat template: {message}", path.display())
            }
            Error::NoTokenizer { dir } => write!(
                f,
                "{}: no tokenizer.json, so text cannot be used (give token ids)",
                dir.display()
            ),
            Error::Compute(e) => e.fmt(f),
            Error::Tensor(e) => e.fmt(f),
            Error::Shard(e) => e.fmt(f),
            Error::Plan(e) => e.fmt(f),
            Error::Dispatch(e) => e.fmt(f),
            Error::Device(e) => e.fmt(f),
            Error::Facade(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Compute(e) => Some(e),
            Error::Tensor(e) => Some(e),
            Error::Shard(e) => Some(e),
            Error::Plan(e) => Some(e),
            Error::Dispatch(e) => Some(e),
            Error::Device(e) => Some(e),
            Error::Facade(e) => Some(e),
            _ => None,
        }
    }
}

impl bigmodel::OutOfMemory for Error {
    /// A device that ran out of memory while computing (a KV cache or an
    /// activation on a GPU, or an emulated GPU's budget), loading or
    /// streaming weights.
    fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Compute(bm_compute::Error::Device(e)) | Error::Device(e) => e.is_out_of_memory(),
            Error::Dispatch(e) => e.is_out_of_memory(),
            Error::Facade(e) => e.is_out_of_memory(),
            _ => false,
        }
    }
}

impl From<bm_compute::Error> for Error {
    fn from(e: bm_compute::Error) -> Self {
        Error::Compute(e)
    }
}

impl From<bm_tensor::Error> for Error {
    fn from(e: bm_tensor::Error) -> Self {
        Error::Tensor(e)
    }
}

impl From<bm_shard::Error> for Error {
    fn from(e: bm_shard::Error) -> Self {
        Error::Shard(e)
    }
}

impl From<bigmodel::plan::Error> for Error {
    fn from(e: bigmodel::plan::Error) -> Self {
        match e {
            // The config reader is shared with the planner; its errors are
            // this crate's config errors.
            bigmodel::plan::Error::Config { file, key, message } => Error::Config {
                path: file,
                key,
                message,
            },
            other => Error::Plan(other),
        }
    }
}

impl From<bigmodel::dispatch::Error> for Error {
    fn from(e: bigmodel::dispatch::Error) -> Self {
        Error::Dispatch(e)
    }
}

impl From<bigmodel::device::Error> for Error {
    fn from(e: bigmodel::device::Error) -> Self {
        Error::Device(e)
    }
}

impl From<bigmodel::Error> for Error {
    fn from(e: bigmodel::Error) -> Self {
        match e {
            bigmodel::Error::Shard(e) => Error::Shard(e),
            bigmodel::Error::Plan(e) => e.into(),
            bigmodel::Error::Dispatch(e) => Error::Dispatch(e),
            bigmodel::Error::Memory(e) => Error::Device(e),
            other => Error::Facade(other),
        }
    }
}
