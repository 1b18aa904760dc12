//! The one error type of the facade: what failed, with the typed error of
//! the layer it failed in.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong in the facade's calls. Each variant keeps
/// the typed error of the layer that failed, so callers can still match on
/// a device, checkpoint, planning or dispatch error.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A `device_map` string that is no strategy (Accelerate's message).
    UnknownStrategy(String),
    /// `experts_on` without a `device_map` to place the rest of the model.
    ExpertsWithoutMap,
    /// The offload folder holds the checkpoint being read: its index and
    /// `.dat` files would be written beside, or over, the source.
    OffloadIntoCheckpoint {
        /// The offload folder as given.
        folder: PathBuf,
        /// The checkpoint's file found there.
        file: PathBuf,
    },
    /// Reading the machine's memory for default budgets failed.
    Memory(bm_device::Error),
    /// Opening a checkpoint (headers, index, shards) failed.
    Shard(bm_shard::Error),
    /// Building a module tree, a budget or a plan failed.
    Plan(bm_plan::Error),
    /// Loading the checkpoint into the model or dispatching it failed.
    Dispatch(bm_dispatch::Error),
    /// [`crate::find_executable_batch_size`] halved the batch size down to
    /// zero: every size ran out of memory.
    NoExecutableBatchSize {
        /// The batch size tried first.
        starting_batch_size: usize,
        /// The out-of-memory error of the last try (at batch size 1).
        last_error: Option<String>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownStrategy(_) => f.write_str(
                "If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or 'sequential'.",
            ),
            Error::ExpertsWithoutMap => f.write_str(
                "`experts_on` needs a `device_map` (a strategy or a map) for the rest of the model",
            ),
            Error::OffloadIntoCheckpoint { folder, file } => write!(
                f,
                "offload folder {} holds the checkpoint being read ({}); offload to another folder",
                folder.display(),
                file.display()
            ),
            Error::Memory(e) => write!(f, "reading the machine's memory: {e}"),
            Error::Shard(e) => e.fmt(f),
            Error::Plan(e) => e.fmt(f),
            Error::Dispatch(e) => e.fmt(f),
            Error::NoExecutableBatchSize {
                starting_batch_size,
                last_error,
            } => {
                write!(
                    f,
                    "No executable batch size found, reached zero (started at {starting_batch_size}, halving on each out-of-memory error)"
                )?;
                match last_error {
                    Some(e) => write!(f, "; the last try failed with: {e}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::UnknownStrategy(_)
            | Error::ExpertsWithoutMap
            | Error::OffloadIntoCheckpoint { .. }
            | Error::NoExecutableBatchSize { .. } => None,
            Error::Memory(e) => Some(e),
            Error::Shard(e) => Some(e),
            Error::Plan(e) => Some(e),
            Error::Dispatch(e) => Some(e),
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

impl From<bm_dispatch::Error> for Error {
    fn from(e: bm_dispatch::Error) -> Self {
        Error::Dispatch(e)
    }
}
