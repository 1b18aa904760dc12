//! `bigmodel shard`: rewrite a checkpoint as shards transformers loads.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use bigmodel::shard::{Checkpoint, SaveTensor, ShardOptions, parse_size, shard_checkpoint};
use bigmodel::tensor::{DType, MmapView};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use super::CmdResult;

/// Arguments of `bigmodel shard`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint to read: a .safetensors file, a *.index.json, or a folder.
    pub checkpoint: PathBuf,
    /// Folder to write into (created if needed); must not be the checkpoint's own folder.
    pub out_dir: PathBuf,
    /// Largest shard: bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB.
    #[arg(long)]
    pub max_shard_size: String,
    /// Convert float tensors to this dtype (f32, f16, bf16); others are copied.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Write one JSON document to stdout (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    // Everything that can be checked is checked before anything is written.
    let max_shard_size = parse_size(&args.max_shard_size)?;
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let ckpt = Checkpoint::open(&args.checkpoint)?;
    refuse_own_folder(&ckpt, &args.out_dir)?;

    let views: Vec<MmapView> = ckpt
        .tensors()
        .map(|(name, _)| ckpt.view(name))
        .collect::<Result<_, _>>()?;
    let tensors: Vec<SaveTensor<'_>> = ckpt
        .tensors()
        .zip(&views)
        .map(|((name, meta), view)| SaveTensor {
            name,
            meta,
            data: view.as_bytes(),
        })
        .collect();

    let bar = if !args.json && std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )?);
    let options = ShardOptions {
        max_shard_size,
        dtype,
    };
    let saved = shard_checkpoint(&tensors, &args.out_dir, &options, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    let copied = copy_side_files(&ckpt, &args.out_dir)?;

    if args.json {
        let files: Vec<_> = saved
            .shards
            .iter()
            .map(
                |s| json!({"file": s.file_name, "tensors": s.tensors.len(), "bytes": s.data_bytes}),
            )
            .collect();
        let report = json!({
            "output": args.out_dir,
            "files": files,
            "index": saved.index,
            "tensors": saved.shards.iter().map(|s| s.tensors.len()).sum::<usize>(),
            "total_size": saved.total_size,
            "dropped_ties": saved.dropped_ties,
            "removed": saved.removed,
            "copied": copied,
        });
        super::inspect::print_stdout(&(serde_json::to_string_pretty(&report)? + "\n"))
    } else {
        let mut out = format!(
            "wrote {} file(s), {} of tensor data, to {}\n",
            saved.shards.len(),
            super::inspect::human_bytes(saved.total_size),
            args.out_dir.display()
        );
        for s in &saved.shards {
            out += &format!(
                "  {}  {} tensors  {} bytes\n",
                s.file_name,
                s.tensors.len(),
                s.data_bytes
            );
        }
        if let Some(index) = &saved.index {
            out += &format!("  {}\n", index.display());
        }
        for (dropped, kept) in &saved.dropped_ties {
            out += &format!("tied: {dropped} shares its bytes with {kept} and was stored once\n");
        }
        for p in &saved.removed {
            out += &format!("removed stale {}\n", p.display());
        }
        for p in &copied {
            out += &format!("copied {}\n", p.display());
        }
        super::inspect::print_stdout(&out)
    }
}

/// Copies the non-weight files of a checkpoint folder (config.json,
/// tokenizer files, ...) so that the output loads with `from_pretrained`.
fn copy_side_files(ckpt: &Checkpoint, out_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let source = ckpt.path();
    let folder = if source.is_dir() {
        source
    } else if ckpt.index_path().is_some() {
        match source.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        }
    } else {
        return Ok(Vec::new()); // a lone .safetensors file has no side files
    };
    let weights = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".index.json",
    ];
    let listing =
        std::fs::read_dir(folder).map_err(|e| format!("listing {}: {e}", folder.display()))?;
    let mut copied = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| format!("listing {}: {e}", folder.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if !is_file || name.starts_with('.') || weights.iter().any(|w| name.ends_with(w)) {
            continue;
        }
        let dest = out_dir.join(&name);
        let temp = out_dir.join(format!(".{name}.tmp{}", std::process::id()));
        std::fs::copy(entry.path(), &temp)
            .and_then(|_| std::fs::rename(&temp, &dest))
            .map_err(|e| {
                let _ = std::fs::remove_file(&temp);
                format!(
                    "copying {} to {}: {e}",
                    entry.path().display(),
                    dest.display()
                )
            })?;
        copied.push(dest);
    }
    copied.sort();
    Ok(copied)
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(format!(
            "--dtype {s:?}: expected f32, f16 or bf16 (or float32, float16, bfloat16)"
        )),
    }
}

/// Writing into the folder the checkpoint is read from would replace or
/// remove the very files being read.
fn refuse_own_folder(ckpt: &Checkpoint, out_dir: &Path) -> Result<(), String> {
    let Ok(out) = out_dir.canonicalize() else {
        return Ok(()); // does not exist yet, so it holds no source file
    };
    let sources = ckpt
        .files()
        .iter()
        .map(|f| f.path.as_path())
        .chain(ckpt.index_path());
    for source in sources {
        let parent = source
            .canonicalize()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf));
        if parent.as_deref() == Some(out.as_path()) {
            return Err(format!(
                "{} holds the checkpoint being read ({}); write to another folder",
                out_dir.display(),
                source.display()
            ));
        }
    }
    Ok(())
}
