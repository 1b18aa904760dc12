//! Checkpoints in the formats of the Hugging Face ecosystem: safetensors,
//! read lazily and written atomically, and PyTorch `.bin` files, read
//! lazily without running their pickle.
//!
//! A checkpoint for a model larger than any device is mostly bytes this
//! process should not touch until the moment they go to their device. So
//! [`Checkpoint::open`] reads and validates only the headers (a few KB per
//! file, even for a file of hundreds of GB) and maps the files; tensor bytes
//! are read when asked for, zero-copy through [`Checkpoint::view`] (or
//! [`Checkpoint::bytes`], which also gathers a strided view of a PyTorch
//! storage) or into an aligned host buffer through [`Checkpoint::read_as`],
//! which also converts float dtypes bit for bit as PyTorch does.
//!
//! What is read:
//! * a `.safetensors` file;
//! * an index: transformers' `{"metadata":{...},"weight_map":{name: file}}`
//!   or Accelerate's flat `{name: file}`; shard names are checked before any
//!   file is opened (no absolute paths, no `..`, no symbolic link leading
//!   outside the folder or, for a Hugging Face cache snapshot, its
//!   repository: see [`resolve_in_folder`]), and only regular files are
//!   opened ([`open_regular`]);
//! * a PyTorch `torch.save` file (`pytorch_model.bin`: the zip archive of
//!   PyTorch 1.6 and later, or the older format), read by [`torch`]'s own
//!   unpickler, which rebuilds tensors and plain containers and never runs
//!   code: any other global the pickle names is refused by name;
//! * a folder, read as transformers reads one: `model.safetensors`, else its
//!   one safetensors index, else `pytorch_model.bin`, else its one
//!   `pytorch_model.bin.index.json`.
//!
//! Headers are validated as strictly as the safetensors crate does (see
//! [`Header`]), and every error names the file, tensor or key at fault.
//!
//! What is written: [`shard_checkpoint`] splits tensors with
//! huggingface_hub's rule ([`split_into_shards`]) into files named as
//! transformers names them, with an index byte-identical to the one
//! transformers writes. Unlike Accelerate it never leaves a half-written
//! checkpoint (temporary files, renamed into place, index last) and removes
//! stale shards of an earlier save. [`offload`] reads and writes
//! Accelerate's disk-offload folder. Every file is written through
//! [`AtomicFile`], which never opens an existing name or follows a link;
//! a writer of a folder other processes may write too (a shard output, an
//! offload folder) holds its [`FolderLock`] for the whole write and commit,
//! and a temporary is taken for stale only when no process holds its
//! writer's lock, never by its pid ([`remove_stale_temps`]).
//!
//! This crate never allocates device memory and never decides where a tensor
//! goes; it depends only on `bm-tensor`, `serde_json` and `memmap2`.

mod atomic;
mod checkpoint;
mod error;
mod header;
mod index;
mod json;
mod lock;
pub mod offload;
mod paths;
mod size;
pub mod torch;
mod write;

pub use atomic::{
    AtomicFile, FinishedFile, STALE_AGE, TempFolder, create_temp_folder, remove_in_flight,
    remove_stale_temps, sync_folder, write_atomic,
};
pub use checkpoint::{Checkpoint, Format, ShardFile, TensorBytes, cast_target};
pub use error::Error;
pub use header::{Header, HeaderTensor, MAX_HEADER_LEN};
pub use index::{Index, check_shard_name};
pub use lock::{FolderLock, LOCK_FILE, Notice, Sharing, writer_of};
pub use paths::{Resolved, exists, open_regular, read_regular, resolve_in_folder};
pub use size::parse_size;
pub use write::{
    INDEX_FILE, SINGLE_FILE, SaveTensor, SavedCheckpoint, SavedShard, ShardItem, ShardOptions,
    shard_checkpoint, shard_file_name, split_into_shards,
};
