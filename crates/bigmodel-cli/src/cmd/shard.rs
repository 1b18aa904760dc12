//! `bigmodel shard`: rewrite a checkpoint as shards transformers loads.
//! [`write`] is also `bigmodel convert`'s.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use bigmodel::plan::human_bytes;
use bigmodel::shard::{
    AtomicFile, Checkpoint, Error as ShardError, FolderLock, SaveTensor, ShardOptions, Sharing,
    TensorBytes, parse_size, resolve_in_folder, shard_checkpoint, sync_folder,
};
use bigmodel::tensor::{DType, TensorMeta};
use bm_models::{OwnedEntry, SaveQuantized};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use super::CmdResult;

/// Arguments of `bigmodel shard`.
#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint to read: a .safetensors or PyTorch .bin file, a *.index.json, or a folder.
    pub checkpoint: PathBuf,
    /// Folder to write into (created if needed); must not be the checkpoint's own folder.
    pub out_dir: PathBuf,
    /// Largest shard: bytes, or a number with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB.
    #[arg(long)]
    pub max_shard_size: String,
    /// Convert float tensors to this dtype (f32, f16, bf16); others are copied.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize the linear layers as transformers saves a bitsandbytes
    /// model (nf4, fp4, int8), from their values in --dtype (else as
    /// stored), and add `quantization_config` to config.json. Needs the
    /// model folder's config.json.
    #[arg(long, value_name = "nf4|fp4|int8")]
    pub quantize: Option<String>,
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
    let max_shard_size =
        parse_size(&args.max_shard_size).map_err(|e| format!("--max-shard-size: {e}"))?;
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    let quantize = args
        .quantize
        .as_deref()
        .map(super::run::parse_quantize)
        .transpose()?;
    let ckpt = Checkpoint::open(&args.checkpoint)?;
    refuse_own_folder(&ckpt, &args.out_dir)?;
    let sharing = super::run::sharing(args.wait_lock);
    let Some(quantize) = quantize else {
        let options = ShardOptions {
            max_shard_size,
            dtype,
        };
        return write(&ckpt, &args.out_dir, &options, args.json, None, &sharing);
    };
    let folder = model_folder(&ckpt);
    let saver = SaveQuantized::new(&folder, &quantize)
        .map_err(|e| format!("--quantize: {}: {e}", folder.display()))?;
    let config = quantized_config(&folder, &saver, dtype)?;
    // Casting happens before quantizing; the writer must not cast the
    // quant state's f32 parts.
    let options = ShardOptions {
        max_shard_size,
        dtype: None,
    };
    let quantized = Quantized {
        saver: &saver,
        dtype,
        config,
    };
    write(
        &ckpt,
        &args.out_dir,
        &options,
        args.json,
        Some(quantized),
        &sharing,
    )
}

/// What `shard --quantize` adds to [`write`]: the quantizer, the dtype the
/// quantized weights' values are read in, and the output's config.json.
pub struct Quantized<'a> {
    saver: &'a SaveQuantized,
    dtype: Option<DType>,
    /// The source folder's config.json with `quantization_config`.
    config: String,
}

/// The folder a checkpoint was read from: itself, or the folder of its
/// index or file.
fn model_folder(ckpt: &Checkpoint) -> PathBuf {
    let source = ckpt.path();
    if source.is_dir() {
        return source.to_path_buf();
    }
    match source.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The output's config.json: the source folder's, with transformers'
/// `quantization_config` (and `dtype` when one was asked for).
fn quantized_config(
    folder: &Path,
    saver: &SaveQuantized,
    dtype: Option<DType>,
) -> Result<String, Box<dyn std::error::Error>> {
    let path = folder.join("config.json");
    let mut config = super::read_json(&path)?;
    let Some(object) = config.as_object_mut() else {
        return Err(format!("{}: not a JSON object", path.display()).into());
    };
    object.insert("quantization_config".into(), saver.quantization_config());
    if let Some(d) = dtype {
        object.insert("dtype".into(), json!(d.as_torch_str()));
    }
    Ok(serde_json::to_string_pretty(&config)? + "\n")
}

/// Writes `ckpt` into `out_dir` as `shard` does, with its side files, and
/// reports what was written. With `quantize`, the weights it quantizes
/// are written as its entries, from their values in the given dtype, and
/// other float tensors are cast to that dtype here (the quantized model is
/// held in memory at its packed size until it is written).
///
/// The shards and side files are written under `out_dir`'s lock
/// ([`FolderLock`], waiting as `sharing` says), config.json last: a folder
/// whose config.json is the new one holds everything else new too.
pub fn write(
    ckpt: &Checkpoint,
    out_dir: &Path,
    options: &ShardOptions,
    json: bool,
    quantize: Option<Quantized<'_>>,
    sharing: &Sharing,
) -> CmdResult {
    // Names of one tensor (tied weights a PyTorch file stores under each
    // name) share one buffer, so the writer stores them once.
    let mut first_name: HashMap<&str, &str> = HashMap::new();
    for group in ckpt.ties() {
        for name in &group[1..] {
            first_name.insert(name, group[0]);
        }
    }
    let mut data: HashMap<&str, TensorBytes> = HashMap::new();
    for (name, _) in ckpt.tensors() {
        if !first_name.contains_key(name) {
            data.insert(name, ckpt.bytes(name)?);
        }
    }
    // Quantized entries and cast copies, made before writing.
    let mut made: Vec<OwnedEntry> = Vec::new();
    let mut replaced: std::collections::HashSet<&str> = std::collections::HashSet::new();
    if let Some(Quantized { saver, dtype, .. }) = &quantize {
        let dtype = *dtype;
        for (name, meta) in ckpt.tensors() {
            let target = dtype
                .filter(|_| meta.dtype.is_float())
                .unwrap_or(meta.dtype);
            if saver.quantizes(name) {
                made.extend(saver.entries(name, ckpt, target)?);
            } else if target != meta.dtype && !first_name.contains_key(name) {
                let cast = ckpt.read_as(name, target)?;
                let meta = TensorMeta::new(target, meta.shape.clone());
                made.push((name.to_string(), meta, cast.as_bytes().to_vec()));
            } else {
                continue;
            }
            replaced.insert(name);
        }
    }
    let made_names: HashMap<&str, usize> = made
        .iter()
        .enumerate()
        .map(|(i, (n, _, _))| (n.as_str(), i))
        .collect();
    let mut tensors: Vec<SaveTensor<'_>> = ckpt
        .tensors()
        .filter(|(name, _)| !replaced.contains(name))
        .map(|(name, meta)| {
            let source = first_name.get(name).unwrap_or(&name);
            match made_names.get(source) {
                // A tied name of a tensor cast above.
                Some(&i) => SaveTensor {
                    name,
                    meta: &made[i].1,
                    data: &made[i].2,
                },
                None => SaveTensor {
                    name,
                    meta,
                    data: data[source].as_bytes(),
                },
            }
        })
        .collect();
    tensors.extend(made.iter().map(|(name, meta, bytes)| SaveTensor {
        name,
        meta,
        data: bytes,
    }));

    let bar = if !json && std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )?);
    let lock = FolderLock::acquire(out_dir, sharing)?;
    let saved = shard_checkpoint(&tensors, out_dir, options, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .map_err(|e| match &e {
        // Name the file the bad tensor came from, not only the output.
        ShardError::InvalidTensor { name, .. } => match ckpt.file_of(name) {
            Some(file) => format!("{e} (read from {})", file.display()),
            None => e.to_string(),
        },
        _ => e.to_string(),
    })?;
    bar.finish_and_clear();
    let config = quantize.as_ref().map(|q| q.config.as_bytes());
    let copied = copy_side_files(ckpt, out_dir, config)?;
    drop(lock);

    if json {
        let files: Vec<_> = saved
            .shards
            .iter()
            .map(
                |s| json!({"file": s.file_name, "tensors": s.tensors.len(), "bytes": s.data_bytes}),
            )
            .collect();
        let report = json!({
            "output": out_dir,
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
            human_bytes(saved.total_size),
            out_dir.display()
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
/// Each is resolved like a shard (a link may lead into the folder or its
/// Hugging Face cache repository, nowhere else) and written atomically;
/// folders, FIFOs and other non-files are left alone. config.json comes
/// last, as `config` when given (written even for a lone file).
fn copy_side_files(
    ckpt: &Checkpoint,
    out_dir: &Path,
    config: Option<&[u8]>,
) -> Result<Vec<PathBuf>, String> {
    let mut copied = copy_side_files_but_config(ckpt, out_dir, config.is_some())?;
    if let Some(text) = config {
        let dest = out_dir.join(CONFIG);
        bigmodel::shard::write_atomic(&dest, text).map_err(|e| e.to_string())?;
        copied.push(dest);
    }
    Ok(copied)
}

const CONFIG: &str = "config.json";

/// [`copy_side_files`] for every side file but a replaced config.json, the
/// source's config.json (when `replaced` is false) last.
fn copy_side_files_but_config(
    ckpt: &Checkpoint,
    out_dir: &Path,
    replaced: bool,
) -> Result<Vec<PathBuf>, String> {
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
    let mut entries = Vec::new();
    for entry in listing {
        let entry = entry.map_err(|e| format!("listing {}: {e}", folder.display()))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue; // not UTF-8: no file transformers reads
        };
        if !(replaced && name == CONFIG) {
            entries.push((name, entry));
        }
    }
    entries.sort_by_key(|(name, _)| name == CONFIG);
    let mut copied = Vec::new();
    for (name, entry) in entries {
        // file_type() does not follow links: a link is resolved below.
        let file_type = entry
            .file_type()
            .map_err(|e| format!("reading the type of {}: {e}", entry.path().display()))?;
        // A link to a folder, a FIFO or nothing is not a side file.
        let candidate = file_type.is_file()
            || file_type.is_symlink() && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file());
        if !candidate || name.starts_with('.') || weights.iter().any(|w| name.ends_with(w)) {
            continue;
        }
        let side = resolve_in_folder(folder, &name)
            .map_err(|problem| format!("{}, which {problem}", entry.path().display()))?;
        let dest = out_dir.join(&name);
        let mut from = side.open().map_err(|e| e.to_string())?;
        let mut to = AtomicFile::create(&dest).map_err(|e| e.to_string())?;
        std::io::copy(&mut from, &mut to).map_err(|e| {
            format!(
                "copying {} to {}: {e}",
                side.named.display(),
                dest.display()
            )
        })?;
        to.commit().map_err(|e| e.to_string())?;
        copied.push(dest);
    }
    sync_folder(out_dir).map_err(|e| e.to_string())?;
    Ok(copied)
}

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(format!(
            "--dtype {s:?}: expected f32, f16 or bf16 (or float32, float16, bfloat16)"
        )),
    }
}

/// `shard` never modifies, removes or writes through anything it reads, so
/// the output folder must not be a folder the checkpoint is read from: not
/// the folder of the index or of any shard as named, nor the folder a
/// shard's link resolves to (a Hugging Face cache snapshot's shards are
/// links into `blobs/`), whatever links lead to the output folder.
pub fn refuse_own_folder(ckpt: &Checkpoint, out_dir: &Path) -> Result<(), String> {
    match ckpt.file_in_folder(out_dir) {
        Some(source) => Err(format!(
            "{} holds the checkpoint being read ({}); write to another folder",
            out_dir.display(),
            source.display()
        )),
        None => Ok(()),
    }
}
