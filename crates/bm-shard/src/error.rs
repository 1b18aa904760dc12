//! The one error type of the crate.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong reading or writing a checkpoint. Every
/// message names the file, tensor or key at fault.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A file system operation failed.
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done (`"reading"`, `"creating"`, ...).
        action: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A safetensors file whose header is malformed or inconsistent.
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A `*.index.json` (or offload `index.json`) that cannot be used.
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A path that is not a checkpoint this crate can read.
    Checkpoint {
        /// The path given.
        path: PathBuf,
        /// Why it cannot be read.
        problem: String,
    },
    /// A PyTorch checkpoint (a `torch.save` zip archive or a legacy pickle
    /// file) that cannot be read, or whose pickle asks for anything but
    /// tensors and plain containers.
    Torch {
        /// The file.
        path: PathBuf,
        /// The record at fault (`archive/data.pkl`, `archive/data/3`), when
        /// one is.
        record: Option<String>,
        /// What is wrong with it.
        problem: String,
    },
    /// The checkpoint has no tensor of this name.
    UnknownTensor {
        /// The name asked for.
        name: String,
        /// The checkpoint (file, index or folder).
        checkpoint: PathBuf,
    },
    /// A size string such as `--max-shard-size` that does not parse.
    Size {
        /// The text given.
        input: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Tensors handed to a writer that cannot be written as given, or a
    /// tensor read into a buffer of the wrong size.
    InvalidTensor {
        /// The file or folder it is read from or written to.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Another process holds the folder's lock: it is writing the folder
    /// (see [`crate::FolderLock`]).
    Locked {
        /// The folder.
        folder: PathBuf,
        /// `pid N on HOST`, as the holder wrote it.
        holder: String,
        /// How long this process waited, when it waited.
        waited: Option<std::time::Duration>,
    },
    /// A tensor-level operation (a cast, an allocation) failed.
    Tensor {
        /// The file the tensor is read from or written to.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The underlying error.
        source: bm_tensor::Error,
    },
}

impl Error {
    pub(crate) fn io(
        path: impl Into<PathBuf>,
        action: &'static str,
        source: std::io::Error,
    ) -> Self {
        Error::Io {
            path: path.into(),
            action,
            source,
        }
    }

    pub(crate) fn header(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Header {
            path: path.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn index(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Index {
            path: path.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn torch(
        path: impl Into<PathBuf>,
        record: Option<&str>,
        problem: impl Into<String>,
    ) -> Self {
        Error::Torch {
            path: path.into(),
            record: record.map(str::to_string),
            problem: problem.into(),
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            problem: problem.into(),
        }
    }

    pub(crate) fn invalid_tensor(
        path: impl Into<PathBuf>,
        name: &str,
        problem: impl Into<String>,
    ) -> Self {
        Error::InvalidTensor {
            path: path.into(),
            name: name.to_string(),
            problem: problem.into(),
        }
    }

    pub(crate) fn tensor(path: impl Into<PathBuf>, name: &str, source: bm_tensor::Error) -> Self {
        Error::Tensor {
            path: path.into(),
            name: name.to_string(),
            source,
        }
    }

    /// A mapped file that shrank since it was opened: reading `name` from
    /// it would fault.
    pub(crate) fn truncated(path: &std::path::Path, name: &str, needed: u64, len: u64) -> Self {
        Error::checkpoint(
            path,
            format!(
                "tensor {name:?} cannot be read: the file shrank to {len} bytes since it was opened and the tensor ends at byte {needed} (another program rewrote or truncated it; files must not change while in use)"
            ),
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io {
                path,
                action,
                source,
            } => write!(f, "{action} {}: {source}", path.display()),
            Error::Header { path, problem } => {
                write!(f, "{}: invalid safetensors file: {problem}", path.display())
            }
            Error::Index { path, problem } => {
                write!(f, "{}: invalid index: {problem}", path.display())
            }
            Error::Checkpoint { path, problem } => write!(f, "{}: {problem}", path.display()),
            Error::Torch {
                path,
                record: Some(record),
                problem,
            } => write!(f, "{}: record {record}: {problem}", path.display()),
            Error::Torch {
                path,
                record: None,
                problem,
            } => write!(f, "{}: {problem}", path.display()),
            Error::UnknownTensor { name, checkpoint } => {
                write!(f, "{}: no tensor named {name:?}", checkpoint.display())
            }
            Error::Size { input, problem } => write!(f, "size {input:?}: {problem}"),
            Error::InvalidTensor {
                path,
                name,
                problem,
            } => write!(f, "{}: tensor {name:?}: {problem}", path.display()),
            Error::Tensor { path, name, source } => {
                write!(f, "{}: tensor {name:?}: {source}", path.display())
            }
            Error::Locked {
                folder,
                holder,
                waited,
            } => {
                write!(f, "{} is being written by {holder}", folder.display())?;
                match waited.filter(|w| !w.is_zero()) {
                    Some(w) => write!(f, " (still, after waiting {} s for it)", w.as_secs()),
                    None => f.write_str("; try again when it has finished"),
                }
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Tensor { source, .. } => Some(source),
            _ => None,
        }
    }
}
