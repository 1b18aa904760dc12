//! `bigmodel convert`: a PyTorch checkpoint (`pytorch_model.bin`, sharded or
//! not) rewritten as safetensors, sharded exactly as `bigmodel shard`
//! shards. The `.bin` files are read without running their pickle.

use std::path::PathBuf;

use bigmodel::shard::{Checkpoint, ShardOptions, parse_size};

use super::CmdResult;
use super::shard::{parse_dtype, refuse_own_folder, write};

/// Arguments of `bigmodel convert`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint to read: a PyTorch .bin file, a pytorch_model.bin.index.json, or a folder
    /// (any checkpoint `inspect` reads; a folder with safetensors is read as safetensors).
    pub input: PathBuf,
    /// Folder to write into (created if needed); must not be the input's own folder.
    pub out_dir: PathBuf,
    /// Largest shard: bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB.
    /// transformers' default.
    #[arg(long, default_value = "50GB")]
    pub max_shard_size: String,
    /// Convert float tensors to this dtype (f32, f16, bf16); others are copied.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Write one JSON document to stdout (and no progress bar).
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for another process writing OUT_DIR (default: as
    /// long as it takes; 0 fails at once).
    #[arg(long, value_name = "SECONDS")]
    pub wait_lock: Option<u64>,
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    // Everything that can be checked is checked before anything is written.
    let options = ShardOptions {
        max_shard_size: parse_size(&args.max_shard_size)
            .map_err(|e| format!("--max-shard-size: {e}"))?,
        dtype: args.dtype.as_deref().map(parse_dtype).transpose()?,
    };
    let ckpt = Checkpoint::open(&args.input)?;
    refuse_own_folder(&ckpt, &args.out_dir)?;
    let sharing = super::run::sharing(args.wait_lock);
    write(&ckpt, &args.out_dir, &options, args.json, None, &sharing)
}
