//! The one error type of `bm-dispatch`.

use std::fmt;

/// Everything that can go wrong building, loading, dispatching or running a
/// model. Every message names the tensor, module, device or file at fault.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a checkpoint or offload folder failed.
    Shard(bm_shard::Error),
    /// Building a module tree, checking or planning a device map failed.
    Plan(bm_plan::Error),
    /// A device had no room for a tensor or activation: its budget, or the
    /// driver's free memory, ran out.
    OutOfDeviceMemory {
        /// The tensor or activation being placed.
        what: String,
        /// The device.
        device: bm_device::Device,
        /// Bytes asked for.
        requested: u64,
        /// Bytes that were free (within the budget, or as the driver saw it).
        free: u64,
        /// The underlying error (the budget, or the driver).
        source: Box<bm_device::Error>,
    },
    /// A device operation (allocation, copy) failed; `what` says for what.
    Device {
        /// The tensor or activation being placed.
        what: String,
        /// The underlying error (names the device).
        source: bm_device::Error,
    },
    /// A tensor-level operation (cast, allocation) failed.
    Tensor {
        /// The tensor.
        name: String,
        /// The underlying error.
        source: bm_tensor::Error,
    },
    /// Writing an offloaded tensor failed (disk full, permissions).
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Accelerate's shape-mismatch message, plus the full tensor name.
    ShapeMismatch {
        /// Full name of the tensor.
        name: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// Shape the model declares.
        expected: Vec<usize>,
    },
    /// `strict` loading with keys missing from or unexpected in the checkpoint.
    KeysMismatch {
        /// The checkpoint.
        checkpoint: std::path::PathBuf,
        /// Model tensors the checkpoint lacks.
        missing: Vec<String>,
        /// Checkpoint tensors the model lacks.
        unexpected: Vec<String>,
    },
    /// The device map sends modules to disk but no offload folder was given
    /// (Accelerate's message, naming the modules, or "the whole model").
    NoOffloadFolder {
        /// The modules mapped to disk (`""` is the whole model).
        modules: Vec<String>,
        /// Where the budgets that sent them there came from, when a planner
        /// made the map (the facade says; a map given as such has none).
        budgets: Option<String>,
    },
    /// An existing offload folder does not hold the model's tensors.
    OffloadIndexMismatch {
        /// The folder.
        folder: std::path::PathBuf,
        /// What does not match.
        problem: String,
    },
    /// A name that is neither a module nor a tensor of the model.
    UnknownName(String),
    /// A GPU ordinal that the device set lacks.
    NoSuchDevice {
        /// What was being placed there.
        what: String,
        /// The device.
        device: bm_device::Device,
    },
    /// A tensor that has no value (an empty-initialised tensor never loaded).
    NotLoaded(String),
    /// Moving a model that has offloaded parts (Accelerate's message).
    MoveOffloaded,
    /// A bad option value.
    BadOption(String),
    /// A [`LoadTransform`](crate::LoadTransform) failed on a tensor.
    Transform {
        /// The tensor.
        name: String,
        /// The transform's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// True when a device had no room (budget or driver out of memory).
    pub fn is_out_of_device_memory(&self) -> bool {
        matches!(self, Error::OutOfDeviceMemory { .. })
    }

    /// A device error while placing `what`: [`Error::OutOfDeviceMemory`]
    /// when the device had no room, [`Error::Device`] otherwise.
    pub(crate) fn device(what: impl Into<String>, source: bm_device::Error) -> Self {
        let what = what.into();
        match source {
            bm_device::Error::BudgetExceeded {
                device,
                requested,
                live,
                budget,
            } => Error::OutOfDeviceMemory {
                what,
                device,
                requested,
                free: budget.saturating_sub(live),
                source: Box::new(source),
            },
            bm_device::Error::OutOfMemory {
                device,
                requested,
                free,
            } => Error::OutOfDeviceMemory {
                what,
                device,
                requested,
                free,
                source: Box::new(source),
            },
            source => Error::Device { what, source },
        }
    }

    pub(crate) fn tensor(name: impl Into<String>, source: bm_tensor::Error) -> Self {
        Error::Tensor {
            name: name.into(),
            source,
        }
    }
}

/// "GPU 0" or "the CPU".
fn device_name(device: bm_device::Device) -> String {
    match device {
        bm_device::Device::Gpu(i) => format!("GPU {i}"),
        bm_device::Device::Cpu => "the CPU".into(),
    }
}

/// PyTorch's `torch.Size([a, b])` spelling, as Accelerate's messages print it.
fn torch_size(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("torch.Size([{}])", dims.join(", "))
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shard(e) => write!(f, "{e}"),
            Error::Plan(e) => write!(f, "{e}"),
            Error::OutOfDeviceMemory {
                what,
                device,
                requested,
                free,
                source,
            } => write!(
                f,
                "out of memory placing {what} on {}: it needs {requested} bytes and {free} bytes \
                 are free ({source})",
                device_name(*device)
            ),
            Error::Device { what, source } => write!(f, "placing {what}: {source}"),
            Error::Tensor { name, source } => write!(f, "tensor {name}: {source}"),
            Error::Io { path, source } => write!(f, "writing {}: {source}", path.display()),
            Error::ShapeMismatch {
                name,
                found,
                expected,
            } => {
                let local = name.rsplit('.').next().unwrap_or(name);
                write!(
                    f,
                    "Trying to set a tensor of shape {} in \"{local}\" (which has shape {}), this looks incorrect. (tensor {name})",
                    torch_size(found),
                    torch_size(expected)
                )
            }
            Error::KeysMismatch {
                checkpoint,
                missing,
                unexpected,
            } => {
                write!(
                    f,
                    "Error(s) in loading state_dict from {}:",
                    checkpoint.display()
                )?;
                if !missing.is_empty() {
                    write!(f, " Missing key(s): {}.", missing.join(", "))?;
                }
                if !unexpected.is_empty() {
                    write!(f, " Unexpected key(s): {}.", unexpected.join(", "))?;
                }
                Ok(())
            }
            Error::NoOffloadFolder { modules, budgets } => {
                write!(
                    f,
                    "At least one of the model submodule will be offloaded to disk, please pass along an `offload_folder`. (modules on disk: {}",
                    module_list(modules)
                )?;
                match budgets {
                    Some(budgets) => write!(f, "; {budgets})"),
                    None => f.write_str(")"),
                }
            }
            Error::OffloadIndexMismatch { folder, problem } => write!(
                f,
                "offload folder {} does not match the model: {problem}; delete it to have it written again (it only holds copies of weights), or give another folder",
                folder.display()
            ),
            Error::UnknownName(name) => {
                write!(f, "{name:?} is not a module or tensor of the model")
            }
            Error::NoSuchDevice { what, device } => {
                write!(f, "{what}: device {device} is not in the device set")
            }
            Error::NotLoaded(name) => write!(
                f,
                "{name} is on the meta device, we need a `value` to put in on the execution device (it was never loaded)"
            ),
            Error::MoveOffloaded => f.write_str(
                "You can't move a model that has some modules offloaded to cpu or disk.",
            ),
            Error::BadOption(msg) => f.write_str(msg),
            Error::Transform { name, source } => write!(f, "loading {name}: {source}"),
        }
    }
}

/// The modules of a refusal: "the whole model" for the root, else the
/// first few names and how many more.
fn module_list(modules: &[String]) -> String {
    const SHOWN: usize = 8;
    if modules.iter().any(String::is_empty) {
        return "the whole model".into();
    }
    let mut list = modules
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if modules.len() > SHOWN {
        list += &format!(" and {} more", modules.len() - SHOWN);
    }
    list
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Shard(e) => Some(e),
            Error::Plan(e) => Some(e),
            Error::Device { source, .. } => Some(source),
            Error::OutOfDeviceMemory { source, .. } => Some(source.as_ref()),
            Error::Tensor { source, .. } => Some(source),
            Error::Io { source, .. } => Some(source),
            Error::Transform { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

impl From<bm_shard::Error> for Error {
    fn from(e: bm_shard::Error) -> Self {
        Error::Shard(e)
    }
}

impl From<bm_plan::Error> for Error {
    fn from(e: bm_plan::Error) -> Self {
        Error::Plan(e)
    }
}

/// Result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(modules: &[&str], budgets: Option<&str>) -> String {
        Error::NoOffloadFolder {
            modules: modules.iter().map(|m| m.to_string()).collect(),
            budgets: budgets.map(str::to_string),
        }
        .to_string()
    }

    #[test]
    fn the_offload_folder_refusal_names_what_goes_to_disk() {
        let whole = refusal(&[""], Some("budgets: cpu 0 B"));
        assert!(
            whole.ends_with("(modules on disk: the whole model; budgets: cpu 0 B)"),
            "{whole}"
        );
        let few = refusal(&["model.layers.1", "lm_head"], None);
        assert!(
            few.ends_with("(modules on disk: model.layers.1, lm_head)"),
            "{few}"
        );
        let names: Vec<String> = (0..10).map(|i| format!("layers.{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let many = refusal(&names, None);
        assert!(
            many.ends_with("layers.6, layers.7 and 2 more)") && !many.contains("layers.8"),
            "{many}"
        );
    }
}
