//! The one error type of `bm-plan`.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong while building a module tree or planning.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A size string that Accelerate's `convert_file_size_to_int` rejects.
    /// The message is Accelerate's own.
    BadSize(String),
    /// A size that parses but is negative, infinite or absurdly large.
    BadBudget {
        /// The device key or option the size was given for.
        what: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A `max_memory` key that is neither a GPU ordinal, `cpu` nor `disk`.
    UnknownDevice(String),
    /// A malformed `max_memory` or `--reserve` specification.
    BadMemorySpec(String),
    /// A malformed module tree: `path` names the offending node or tensor.
    Tree {
        /// Where in the document (a dotted module path or a JSON pointer).
        path: String,
        /// What is wrong there.
        reason: String,
    },
    /// A config file (or one of its keys) that is malformed or describes
    /// what is not supported.
    Config {
        /// The file.
        file: PathBuf,
        /// The key, dotted for a nested object; empty for the whole file.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A config.json of a model family that is not supported.
    UnsupportedModel {
        /// The file.
        file: PathBuf,
        /// Its `model_type`, if it has one.
        model_type: Option<String>,
        /// Its `architectures`.
        architectures: Vec<String>,
    },
    /// A custom device map that leaves tensors without a device
    /// (Accelerate's `check_device_map` message).
    UncoveredTensors(Vec<String>),
    /// Custom device map keys that name no module and no tensor of the
    /// model, each with the closest real names.
    UnknownDeviceMapKeys(Vec<(String, Vec<String>)>),
    /// A custom device map that is not valid JSON of the expected shape.
    BadDeviceMap(String),
    /// The model does not fit the budgets.
    DoesNotFit(String),
    /// Weights that cannot be quantized as asked.
    NotQuantizable {
        /// The weight, or `(model)` when none could be.
        what: String,
        /// Why.
        reason: String,
    },
    /// Experts were to be placed on their own, but the model has none.
    NoExperts,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadSize(size) => write!(
                f,
                "`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit (like '5.0GB')."
            ),
            Error::BadBudget { what, reason } => {
                write!(f, "bad memory budget for {what}: {reason}")
            }
            // Accelerate's message lists 'mps', which bigmodel does not
            // support (docs/compat.md); naming it as available would
            // contradict the refusal.
            Error::UnknownDevice(key) if key == "mps" => write!(
                f,
                "Device mps (Apple Metal) is not supported by bigmodel; available devices are integers (GPU ordinals), 'cpu' and 'disk'"
            ),
            Error::UnknownDevice(key) => write!(
                f,
                "Device {key} is not recognized, available devices are integers (GPU ordinals), 'cpu' and 'disk'"
            ),
            Error::BadMemorySpec(msg) => write!(f, "bad memory specification: {msg}"),
            Error::Tree { path, reason } => {
                if path.is_empty() {
                    write!(f, "invalid module tree: {reason}")
                } else {
                    write!(f, "invalid module tree at {path}: {reason}")
                }
            }
            Error::Config { file, key, message } if key.is_empty() => {
                write!(f, "{}: {message}", file.display())
            }
            Error::Config { file, key, message } => {
                write!(f, "{}: key {key:?}: {message}", file.display())
            }
            Error::UnsupportedModel {
                file,
                model_type,
                architectures,
            } => {
                let supported: Vec<&str> = crate::config::Family::ALL
                    .iter()
                    .map(|(_, name)| *name)
                    .collect();
                match model_type {
                    Some(t) => write!(f, "{}: model_type {t:?}", file.display())?,
                    None => write!(f, "{}: no \"model_type\"", file.display())?,
                }
                if !architectures.is_empty() {
                    write!(f, " ({})", architectures.join(", "))?;
                }
                write!(
                    f,
                    " is not supported (supported: {}); export the model with tools/export_module_tree.py instead",
                    supported.join(", ")
                )
            }
            Error::UncoveredTensors(names) => write!(
                f,
                "The device_map provided does not give any device for the following parameters: {}",
                names.join(", ")
            ),
            Error::UnknownDeviceMapKeys(keys) => {
                const SHOWN: usize = 5;
                let described: Vec<String> = keys
                    .iter()
                    .take(SHOWN)
                    .map(|(key, closest)| {
                        let closest: Vec<String> =
                            closest.iter().map(|n| format!("{n:?}")).collect();
                        if closest.is_empty() {
                            format!("{key:?}")
                        } else {
                            format!("{key:?} (closest: {})", closest.join(", "))
                        }
                    })
                    .collect();
                let more = match keys.len().saturating_sub(SHOWN) {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                write!(
                    f,
                    "the device map names what is not in the model: {}{more}",
                    described.join("; ")
                )
            }
            Error::BadDeviceMap(msg) => write!(f, "invalid device map: {msg}"),
            Error::NoExperts => write!(
                f,
                "the model has no experts to place (no module list named `experts`: not a \
                 mixture-of-experts model)"
            ),
            Error::DoesNotFit(msg) => write!(f, "{msg}"),
            Error::NotQuantizable { what, reason } => write!(f, "cannot quantize {what}: {reason}"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    pub(crate) fn tree(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Tree {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
